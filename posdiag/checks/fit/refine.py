"""The value the weights fit, not only the nearest grid point: a short line search on rope_theta after the grid.

The grid tries rope_theta x {1/10, 1/4, 4, 10}; a x50 mistake would be named as x10. When a base factor wins, the
loss is scored at points STEP decades apart around the best one (the configured base is the point at x1), walking
outward while the best point is at the edge of those scored, MAX_POINTS forwards at most. The value named is the
vertex of the parabola through the best point and its two neighbours (log scale), and its interval spans every
point scored whose loss is not worse than the best one's by the paired test (z < SAME_Z): the factors the material
cannot tell apart from the best.
"""

from __future__ import annotations

import dataclasses
import math

from posdiag.checks.fit.judging import Comparison, Scored, compare, score
from posdiag.checks.fit.material import Material
from posdiag.model.subject import Subject

STEP = 0.25  # decades between the points of the line search (a factor of 1.78)
MAX_POINTS = 4  # forwards the search may add to the grid's
SAME_Z = 2.0  # a point whose loss is not this many paired standard errors above the best is inside the interval


def refined(subject: Subject, material: Material, configured: Scored, comparisons: list[Comparison],
            decisive: Comparison) -> tuple[Comparison, int]:
    """The decisive rope_theta alternative replaced by the best point of the line search around it, its `fits`
    naming the fitted value and interval; and the forwards the search ran. Other alternatives come back as given."""
    alt = decisive.alternative
    if alt.scaled is None or not decisive.beats:
        return decisive, 0
    points: dict[float, Scored] = {0.0: configured}
    for c in comparisons:
        if c.alternative.scaled is not None and _group(c.alternative.label) == _group(alt.label):
            points[round(math.log10(c.alternative.factor), 6)] = c.scored
    runs = 0
    while runs < MAX_POINTS:
        best = min(points, key=lambda x: points[x].loss)
        wanted = [x for x in (round(best - STEP, 6), round(best + STEP, 6))
                  if x not in points and not _bracketed(points, best, x)]
        if not wanted:
            break
        for x in wanted[:MAX_POINTS - runs]:
            trial = alt.scaled(10 ** x)
            with trial.apply(subject):
                points[x] = score(subject, material, trial.label)
            runs += 1
    best = min(points, key=lambda x: points[x].loss)
    if best == 0.0:  # the search came back to the configured base: the grid's winner stands
        return decisive, runs
    vertex = _vertex(points, best)
    same = [x for x in points if compare(alt, points[best], points[x]).z > -SAME_Z]
    where = f" ({_group(alt.label)}" if _group(alt.label) else ""
    fits = (f"rope_theta ~ {alt.base * 10 ** vertex:.2g}{where} (line search: {alt.base * 10 ** min(same):.2g} to "
            f"{alt.base * 10 ** max(same):.2g} fit as well)")
    winner = dataclasses.replace(alt.scaled(10 ** best), fits=fits)
    return compare(winner, configured, points[best]), runs


def _group(label: str) -> str:
    """The layer type a rope_theta label is for ("" for one base)."""
    return label.split("(", 1)[1] if "(" in label else ""


def _bracketed(points: dict[float, Scored], best: float, x: float) -> bool:
    """Whether a point already scored lies between `best` and `x` (no need to score x)."""
    lo, hi = sorted((best, x))
    return any(lo < p < hi for p in points)


def _vertex(points: dict[float, Scored], best: float) -> float:
    """The minimum of the parabola through the best point and its nearest neighbours on either side (the best
    point itself where it has no neighbour on one side, or the three points are not convex)."""
    left = max((x for x in points if x < best), default=None)
    right = min((x for x in points if x > best), default=None)
    if left is None or right is None:
        return best
    (x0, y0), (x1, y1), (x2, y2) = ((x, points[x].loss) for x in (left, best, right))
    denominator = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denominator
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denominator
    if a <= 0:
        return best
    return min(max(-b / (2 * a), left), right)
