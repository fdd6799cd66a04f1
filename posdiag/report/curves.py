"""What a check's results say against position, as plots to draw: the error at each position (step, shift, layer),
the noise floor and the tolerance it was judged by, and the first position past the tolerance on a path the check
failed. Read from the finished CheckResult only (its metrics and details); nothing here decides a verdict: a
position is marked only on a path the check itself reported failing."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from posdiag.results import CheckResult, Status
from posdiag.verdict import FAIL_RATIO


@dataclass(frozen=True)
class Series:
    """One curve: (x, y) points in x order; `failing` when the check reported this path failing."""

    label: str
    points: tuple[tuple[float, float], ...]
    failing: bool = False


@dataclass(frozen=True)
class Level:
    """A reference the errors were judged by: one value (`y`), or one per x (`points`: a tolerance per shift).
    kind: floor | tolerance | fail (a FAIL above it)."""

    label: str
    kind: str
    y: float | None = None
    points: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Plot:
    """One plot: series against x, the levels they were judged by, and the first failing x (with what failed)."""

    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]
    levels: tuple[Level, ...] = ()
    first_failing: tuple[float, str] | None = None
    log_x: bool = False


def plots_of(result: CheckResult) -> list[Plot]:
    """Every plot a result's data holds: its check's own (per stack for an encoder-decoder), else the per-layer
    table any check may carry."""
    stacks = result.details.get("stacks")
    parts = stacks.items() if isinstance(stacks, dict) and stacks else [("", result.details)]
    plots = []
    for stack, details in parts:
        if not isinstance(details, dict):
            continue
        made = _BY_CHECK.get(result.name, _none)(result, details)
        plots += [_titled(p, stack) for p in made]
    if not plots:
        plots = [p for p in (_layer_plot(result, t) for t in result.tables) if p is not None]
    return plots


def _titled(plot: Plot, stack: str) -> Plot:
    return plot if not stack else Plot(f"{stack}: {plot.title}", plot.x_label, plot.y_label, plot.series,
                                       plot.levels, plot.first_failing, plot.log_x)


def _none(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    return []


def _number(value: Any) -> float | None:
    """A finite float from a figure (a float, or a table cell like '1.2e-07'); None otherwise."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _levels(result: CheckResult) -> tuple[Level, ...]:
    """The run's noise floor and the tolerance the check judged against (its metrics)."""
    out = []
    floor, tolerance = _number(result.metrics.get("noise_floor")), _number(result.metrics.get("tolerance"))
    if floor is not None:
        out.append(Level(f"noise floor {floor:.2g}", "floor", floor))
    if tolerance is not None:
        out.append(Level(f"tolerance {tolerance:.2g}", "tolerance", tolerance))
    return tuple(out)


def first_over(series: Iterable[Series], bound: Callable[[float], float | None]) -> tuple[float, str] | None:
    """The smallest x where a failing series is above its bound at x: (x, the series' label)."""
    found = [(x, s.label) for s in series if s.failing for x, y in s.points
             if (b := bound(x)) is not None and y > b]
    return min(found) if found else None


def readable(series: list[Series]) -> list[Series]:
    """At most SHOWN curves: the failing ones first, the others beyond it drawn as one, the worst of them at each
    x (a path the check passed shows where the passing paths lie, not which is which)."""
    if len(series) <= SHOWN:
        return series
    ordered = sorted(series, key=lambda s: not s.failing)
    kept, rest = ordered[:SHOWN - 1], ordered[SHOWN - 1:]
    worst: dict[float, float] = {}
    for s in rest:
        for x, y in s.points:
            worst[x] = max(worst.get(x, y), y)
    failing = any(s.failing for s in rest)
    label = f"{len(rest)} other paths{' (some failing)' if failing else ''}, the worst at each position"
    return [*kept, Series(label, tuple(sorted(worst.items())), failing)]


def _failing(path: dict[str, Any], result: CheckResult) -> bool:
    """A path the check reported failing: its own status, else the check's."""
    status = path.get("status")
    return str(getattr(status, "value", status)) == "fail" if status is not None else result.status is Status.FAIL


def _against_tolerance(result: CheckResult, series: list[Series], title: str, x_label: str, y_label: str,
                       *, log_x: bool = False) -> list[Plot]:
    if not series:
        return []
    series = readable(series)
    levels = _levels(result)
    tolerance = _number(result.metrics.get("tolerance"))
    first = first_over(series, lambda x: tolerance) if tolerance is not None else None
    return [Plot(title, x_label, y_label, tuple(series), levels, first, log_x)]


def _cache(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """Each cached path's step errors at the last position the step produced."""
    series = []
    for name, path in (details.get("paths") or {}).items():
        if not isinstance(path, dict) or not path.get("step_errors") or not path.get("steps"):
            continue
        points = tuple((float(end) - 1, float(err)) for (_, end), err in zip(path["steps"], path["step_errors"],
                                                                             strict=False) if _number(err) is not None)
        series.append(Series(name, points, _failing(path, result)))
    return _against_tolerance(result, series, "cached decoding vs the full forward, by step",
                              "position (the last token of each step)", "error (relative L2)")


def _generate(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """Each generate() run's logits error per generated step, one curve per row."""
    series = []
    for name, run in (details.get("runs") or {}).items():
        rows = run.get("step_errors") if isinstance(run, dict) else None
        if not isinstance(rows, dict):
            continue
        for row, errors in rows.items():
            label = name if len(rows) == 1 else f"{name} row {row}"
            points = tuple((float(i), float(e)) for i, e in enumerate(errors or ()) if _number(e) is not None)
            series.append(Series(label, points, _failing(run, result)))
    return _against_tolerance(result, series, "generate() vs the teacher-forced forward", "generated step",
                              "logits error (relative L2)")


POSITION = re.compile(r"^(.*?)\s*position (\d+)\)?$")
STEP = re.compile(r"\b(?:generated |decode )?step \d+\b")  # a step of one curve, not a curve of its own
SHOWN = 8  # series drawn one by one; the rest as one curve (the worst of them at each x)


def _serving(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """Each serving path's error by position ("row 0 position 3": one curve per row); the position the check
    names as the first departing one is marked."""
    series, named = [], []
    for name, path in (details.get("paths") or {}).items():
        errors = path.get("errors") if isinstance(path, dict) else None
        if not isinstance(errors, dict):
            continue
        curves: dict[str, list[tuple[float, float]]] = {}
        for key, err in errors.items():
            match = POSITION.match(str(key))
            if match and _number(err) is not None:
                prefix = STEP.sub("", match.group(1)).strip(" (")
                curves.setdefault(prefix, []).append((float(match.group(2)), float(err)))
        failing = _failing(path, result)
        for prefix, points in curves.items():
            series.append(Series(f"{name} {prefix}".strip(), tuple(sorted(points)), failing))
        departs = POSITION.match(str(path.get("first_departing") or ""))
        if failing and departs:
            named.append((float(departs.group(2)), name))
    plots = _against_tolerance(result, series, "each serving path vs one full forward", "position",
                               "error (relative L2)")
    if plots and named:
        p = plots[0]
        plots[0] = Plot(p.title, p.x_label, p.y_label, p.series, p.levels, min(named), p.log_x)
    return plots


def _shift(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """The error of each shift k against its own tolerance (floor + a rounding term that grows with k)."""
    ladder, errors, tolerances = details.get("ladder"), details.get("errors"), details.get("tolerances")
    if not (ladder and errors):
        return []
    points = tuple((float(k), float(e)) for k, e in zip(ladder, errors, strict=False) if _number(e) is not None)
    series = [Series("error", points, result.status is Status.FAIL)]
    levels = [lv for lv in _levels(result) if lv.kind == "floor"]
    bounds = dict(zip((float(k) for k in ladder), (_number(t) for t in tolerances or ()), strict=False))
    if bounds:
        levels.append(Level("tolerance per shift", "tolerance", points=tuple(
            (k, t) for k, t in bounds.items() if t is not None)))
    return [Plot("outputs under a shift of every position by k", "shift k (positions added)", "error (relative L2)",
                 tuple(series), tuple(levels), first_over(series, bounds.get), log_x=True)]


def _rope(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """The applied rotation's error over its tolerance, by position (a FAIL above fail_ratio)."""
    rows = details.get("error_by_position") or []
    curves: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if len(row) == 3 and _number(row[2]) is not None:
            curves.setdefault(str(row[0]), []).append((float(row[1]), float(row[2])))
    if not curves:
        return []
    series = [Series(label, tuple(sorted(points)), result.status is Status.FAIL) for label, points in curves.items()]
    fail = _number(result.metrics.get("fail_ratio")) or FAIL_RATIO
    levels = (Level("tolerance (1x)", "tolerance", 1.0), Level(f"FAIL above {fail:g}x", "fail", fail))
    return [Plot("applied rotation vs the config's", "position", "error / tolerance", tuple(series), levels,
                 first_over(series, lambda x: fail))]


def _compare(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    return _layers_profile(result, details) + _served_routes(result, details)


def _layers_profile(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """`compare`'s mean error per position bucket of each layer (the first layer that differs and the output), each
    against its own tolerance; the onset position the comparison names is marked."""
    profile = details.get("profile")
    if not isinstance(profile, dict) or not profile.get("mean_error"):
        return []
    starts, errors, tolerances = profile.get("bucket_starts") or [], profile["mean_error"], profile.get("tolerance", {})
    names = list(errors)
    shown = [n for n in dict.fromkeys([details.get("first_layer"), details.get("max_ratio_layer"), names[-1]])
             if n in errors] if len(names) > 4 else names
    failing = result.status is Status.FAIL
    series, levels = [], []
    for name in shown:
        points = tuple((float(s), float(v)) for s, v in zip(starts, errors[name], strict=False)
                       if _number(v) is not None)
        series.append(Series(name, points, failing and name == details.get("first_layer", name)))
        tol = _number(tolerances.get(name))
        if tol is not None:
            levels.append(Level(f"tolerance {name} {tol:.2g}", "tolerance", tol))
    onset = _number(details.get("onset_position"))
    first = (onset, str(details.get("first_layer") or "")) if failing and onset is not None else None
    return [Plot("error vs position (mean per bucket, by layer)", "position (bucket start)", "relative error",
                 tuple(series), tuple(levels), first)]


def _served_routes(result: CheckResult, details: dict[str, Any]) -> list[Plot]:
    """A server's routes: |Δ log-prob| per position against the reference's floor there, and the tolerance
    (FAIL_RATIO x the floor); the onset position each failing route names is marked."""
    plots = []
    for name, route in (details.get("routes") or {}).items():
        if not isinstance(route, dict) or not route.get("dlogprob"):
            continue
        start = int(route.get("first_position") or 0)
        d, floor = route["dlogprob"], route.get("floor") or []
        points = tuple((float(start + i), float(v)) for i, v in enumerate(d) if _number(v) is not None)
        floors = tuple((float(start + i), float(v)) for i, v in enumerate(floor) if _number(v) is not None)
        levels = (Level("noise floor (per position)", "floor", points=floors),
                  Level(f"tolerance ({FAIL_RATIO:g}x the floor)", "tolerance",
                        points=tuple((x, FAIL_RATIO * v) for x, v in floors)))
        failing = _failing(route, result)
        onset = _number(route.get("onset_position"))
        first = (onset, name) if failing and onset is not None else None
        plots.append(Plot(f"{name} route: served log-probs vs the reference's", "position", "|Δ log-prob|",
                          (Series(name, points, failing),), levels, first))
    return plots


def _layer_plot(result: CheckResult, table: Any) -> Plot | None:
    """A per-layer table with a noise-floor column (shuffle's residual, positions' errors): each other numeric
    column against the layer, the floor beside it. x is the layer's index (0 = embeddings)."""
    columns = [str(c) for c in table.columns]
    if not columns or columns[0] != "layer" or "noise floor" not in columns:
        return None
    at = columns.index("noise floor")
    values = [c for i, c in enumerate(columns[1:], 1) if i != at and c != "ratio"]
    series = []
    for name in values:
        i = columns.index(name)
        points = tuple((float(n), y) for n, row in enumerate(table.rows) if (y := _number(row[i])) is not None)
        if points:
            series.append(Series(name, points))
    floor = tuple((float(n), y) for n, row in enumerate(table.rows) if (y := _number(row[at])) is not None)
    if not series:
        return None
    layers = ", ".join(f"{n} {row[0]}" for n, row in enumerate(table.rows))
    return Plot(table.title, f"layer ({layers})", "relative L2", tuple(series),
                (Level("noise floor", "floor", points=floor),) if floor else ())


_BY_CHECK: dict[str, Callable[[CheckResult, dict[str, Any]], list[Plot]]] = {
    "cache": _cache, "generate": _generate, "serving": _serving, "shift": _shift, "rope": _rope, "compare": _compare,
}
