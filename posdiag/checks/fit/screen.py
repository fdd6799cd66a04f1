"""The screen before `fit` ranks anything: is this model trained at all? An equivalence test on its context gain.

A trained model predicts its material better than a destroyed twin of it (material.destroyed: the same targets, the
context that makes them predictable taken away), even with its positions broken (a token's own path, bigrams and
what the context holds do not need them); an untrained one does not. The twin's targets are the material's own
(repeated sequences) or a permutation of them (shuffled text), so each twin target is paired with the same token
of the material: d_t = loss_twin(t) - loss_configured(t), gain = mean d, spread = sd(d) / sqrt(n).

- untrained: the gain's interval gain +- SETTLED x spread lies within +-UNTRAINED_GAIN nats (equivalent to 0);
- trained: the gain lies over SETTLED standard errors above 0 (and is not bounded small);
- neither: the rows scored cannot tell; the twin is extended to the whole material before deciding, and a model
  that stays undecided is a SKIP naming the interval.

Measured (docs/checks.md has the table; docs/verdicts.md the spread over models and texts): every default-init zoo
family gains within +-0.01 nats, a default-init SmolLM2-135M up to +0.14 on real text; SmolLM2-135M on shuffled prose
+3.9, its q/k rows interleaved +3.2 or permuted by a wrong converter +1.6 (the old Welch screen gave that one z = 4.7
under its bound of 5 and called it untrained).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from posdiag.checks.fit.judging import Scored, score
from posdiag.checks.fit.material import SCREEN_TARGETS, Material, destroyed
from posdiag.model.subject import Subject

# nats: a gain bounded within +-this is no use of context. Fresh weights are not context-blind on real text: a
# default-init SmolLM2-135M (tied embeddings) gains +0.144 +- 0.054 nats on Python's LICENSE.txt and +0.094 +- 0.060
# on its reference manual (repeated words nearby score higher), so the former 0.1 called it trained and its loss
# near chance a FAIL, "does not predict text". Over 2 real models x 3 texts (benchmarks/constants.py): untrained
# twins |gain| + 3 spreads <= 0.198, trained and broken copies gain - 3 spreads >= 0.78; 0.4 sits between
# (x2.0 both ways). Default-init zoo families: |gain| <= 0.01.
UNTRAINED_GAIN = 0.4
SETTLED = 3.0  # standard errors either bound keeps from the measured gain (tokens are correlated: not 1.64)


@dataclass(frozen=True)
class Screen:
    """The context gain of the configured model over its destroyed twin, paired by target token."""

    gain: float  # nats per target
    spread: float  # its standard error
    targets: int
    loss: float  # the configured model's mean loss over the paired targets
    twin_loss: float

    @property
    def z(self) -> float:
        return self.gain / self.spread if self.spread > 0 else (math.inf if self.gain > 0 else 0.0)

    @property
    def untrained(self) -> bool:
        return bool(np.isfinite(self.gain) and abs(self.gain) + SETTLED * self.spread < UNTRAINED_GAIN)

    @property
    def trained(self) -> bool:
        """Context clearly helps (non-finite losses too: the alternatives' business)."""
        return not self.untrained and (not np.isfinite(self.gain) or self.gain - SETTLED * self.spread > 0)

    def figures(self) -> str:
        return (f"loss {self.loss:.2f} nats on its material, {self.twin_loss:.2f} with the context destroyed: gain "
                f"{self.gain:+.3f} +- {SETTLED * self.spread:.3f} over {self.targets} targets, z = {self.z:.1f}")

    def reason(self) -> str:
        """Why the model cannot be judged, or "" for a trained one."""
        if self.trained:
            return ""
        if self.untrained:
            return (f"the model predicts like an untrained one ({self.figures()}; within +-{UNTRAINED_GAIN:g} nats): "
                    "no configuration can be preferred")
        return (f"cannot tell whether the model is trained ({self.figures()}: neither bounded within "
                f"+-{UNTRAINED_GAIN:g} nats nor {SETTLED:g} standard errors above 0 on the whole material): "
                "no configuration can be preferred")


def context_screen(configured: Scored, twin: Scored) -> Screen:
    """The paired gain: each twin target against the same token among the configured targets (the first ones, as
    many as the twin has); Welch's unpaired spread where the target ids do not match as a multiset."""
    mine = Scored(configured.label, configured.losses[:twin.losses.size], configured.hits[:twin.losses.size],
                  None if configured.targets is None else configured.targets[:twin.losses.size])
    n = twin.losses.size
    if mine.targets is not None and twin.targets is not None and mine.targets.size == n:
        a, b = np.argsort(mine.targets, kind="stable"), np.argsort(twin.targets, kind="stable")
        if np.array_equal(mine.targets[a], twin.targets[b]):
            d = twin.losses[b] - mine.losses[a]
            spread = float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
            return Screen(float(d.mean()), spread, n, mine.loss, twin.loss)
    spread = math.sqrt(float(mine.losses.var(ddof=1)) / n + float(twin.losses.var(ddof=1)) / n) if n > 1 else math.inf
    return Screen(twin.loss - mine.loss, spread, n, mine.loss, twin.loss)


def screened(subject: Subject, material: Material, seed: int) -> tuple[Scored, Screen, str]:
    """The configuration as loaded scored on the material, its screen, and why it cannot be judged ("" when it is
    trained). The first row and its destroyed twin run first: where that shows an untrained model nothing else runs
    (default-init models: one forward); otherwise the rest of the screen and the rest of the material run together,
    and a screen that cannot tell yet takes the twin of the whole material (one more forward) before deciding."""
    rows = material.head_rows(SCREEN_TARGETS)
    head, twin = material.rows(0, rows), destroyed(subject, material.rows(0, rows), seed)
    scored, twin_scored = _pair(subject, head.rows(0, 1), twin.rows(0, 1))
    first = context_screen(scored, twin_scored)
    if rows > 1 and first.untrained:
        return scored, first, first.reason() + " (settled on the screen's first row)"
    rest = material.rows(rows)
    if rows > 1:
        more, more_twin, rest_scored = _screen_and_rest(subject, head.rows(1), twin.rows(1), rest)
        scored, twin_scored = scored.joined(more), twin_scored.joined(more_twin)
    else:
        rest_scored = None
    if rest.ids.shape[0]:
        scored = scored.joined(rest_scored if rest_scored is not None else score(subject, rest, "configured"))
    verdict = context_screen(scored, twin_scored)
    if not (verdict.trained or verdict.untrained) and twin_scored.losses.size < scored.losses.size:
        verdict = context_screen(scored, _whole_twin(subject, material, rest, twin_scored, seed))
    return scored, verdict, verdict.reason()


def _whole_twin(subject: Subject, material: Material, rest: Material, twin: Scored, seed: int) -> Scored:
    """The destroyed twin extended to every target of the material: the rest rows' twins (repeated sequences), or
    the whole text row shuffled."""
    if material.distances:
        return twin.joined(score(subject, destroyed(subject, rest, seed + 1), "destroyed"))
    return score(subject, destroyed(subject, material, seed, tokens=material.ids.shape[1] - 1), "destroyed")


def _screen_and_rest(subject: Subject, head: Material, twin: Material,
                     rest: Material) -> tuple[Scored, Scored, Scored | None]:
    """The screen's other rows, their twins and the rest of the material, in one pass where their widths match."""
    if not (head.ids.shape[1] == twin.ids.shape[1] == rest.ids.shape[1]):
        more, more_twin = _pair(subject, head, twin)
        return more, more_twin, None
    both = score(subject, head.stacked(twin).stacked(rest), "configured")
    more, after = both.split(head.count)
    more_twin, rest_scored = after.split(twin.count)
    return more, more_twin, rest_scored if rest.ids.shape[0] else None


def _pair(subject: Subject, rows: Material, twin: Material) -> tuple[Scored, Scored]:
    """Rows and their destroyed twins scored (one forward where their widths match, as repeated sequences' do)."""
    if twin.ids.shape[1] == rows.ids.shape[1]:
        return score(subject, rows.stacked(twin), "configured").split(rows.count)
    return score(subject, rows, "configured"), score(subject, twin, "destroyed")
