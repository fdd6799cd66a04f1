"""The shift ladder as the model runs in half precision: does the run dtype drift from float64 further into the context?

A half-precision run cannot decide invariance itself (its rounding bound exceeds a unit shift), so the ladder is
decided in float64. But float64 removes a bug that exists only in the dtype as run: positions cast to bfloat16
before the angles are taken (transformers PR #29285's class) round every position above 256, and in float64 they
are exact again. So the same rows are also run as users run them, and each row's drift from its float64 twin is
compared with the base row's (positions 0..T-1, where half precision still holds every position exactly):

    drift(k) = ||f_run(x, pos + k) - f_64(x, pos + k)|| / ||f_64(x, pos + k)||
    bound(k) = max(drift(0), eps_run) + Δ1 · eps_32 · (P_k + 1)

Rounding is the same size at every position (the angles are taken in float32, only cos/sin and the activations
round), so a healthy model's drift stays within FAIL_RATIO bounds at every rung; rounded positions give a
neighbour's angle, a drift the size of a one-position change. eps_32 covers float32 angles against float64 ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posdiag.checks.shift.ladder import Probe, measure
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.verdict import MACHINE_EPSILON, noise_floor, within_band


@dataclass(frozen=True)
class Finer:
    """What the float64 ladder left for the as-run comparison: its rows and final hidden states."""

    probe: Probe
    final: torch.Tensor  # [rows, tokens, hidden] of the float64 run
    delta1: float  # the float64 run's one-position change


@dataclass(frozen=True)
class Drift:
    """Each rung's drift of the run dtype from float64, against the base row's."""

    dtype: str
    base: float  # drift at positions 0..T-1
    drifts: list[float]  # per rung
    bounds: list[float]  # per rung: the base drift (at least one unit) plus float32 angle rounding
    breaks: int | None  # first rung past FAIL_RATIO bounds

    @property
    def worst(self) -> int:
        ratios = [d / b if d == d else float("inf") for d, b in zip(self.drifts, self.bounds, strict=True)]
        return max(range(len(ratios)), key=ratios.__getitem__)


def measure_drift(subject: Subject, stack: str, finer: Finer, seed: int) -> Drift | None:
    """The float64 ladder's rows again in the run dtype, and each rung's drift; None when the run-dtype forward is
    non-finite (a FAIL of its own)."""
    probe, dtype = finer.probe, subject.dtype_name
    as_run = measure(subject, probe, stack, seed)
    if as_run is None:
        return None
    ran, exact = as_run.out.final, finer.final

    def drift(row: int, start: int) -> float:
        return relative_l2(ran[row, start:start + probe.span], exact[row, start:start + probe.span])

    base = drift(probe.base, 0)
    drifts = [drift(r, k if probe.prefix else 0) for r, k in zip(probe.shifted, probe.ladder, strict=True)]
    floor = noise_floor(base, dtype)
    bounds = [floor + finer.delta1 * MACHINE_EPSILON["float32"] * (k + probe.span) for k in probe.ladder]
    breaks = next((i for i, (d, b) in enumerate(zip(drifts, bounds, strict=True)) if not within_band(d / b)), None)
    return Drift(dtype=dtype, base=base, drifts=drifts, bounds=bounds, breaks=breaks)


def broken_summary(drift: Drift, probe: Probe) -> str:
    """The FAIL's sentence: where the run dtype leaves float64, by how much, and what that means."""
    i = drift.breaks if drift.breaks is not None else drift.worst
    k, d = probe.ladder[i], drift.drifts[i]
    return (f"only in {drift.dtype} as run: at shift {k} (positions {k}-{k + probe.span - 1}) the {drift.dtype} "
            f"outputs drift {d:.3g} from float64, {d / drift.bounds[i]:.3g}x their drift at positions "
            f"0-{probe.span - 1} ({drift.base:.3g}, plus float32 angle rounding): positions or rotary angles rounded "
            f"in {drift.dtype}")


def held_clause(drift: Drift) -> str:
    """The PASS's clause: the run dtype tracks float64 as far into the context as the ladder goes."""
    i = drift.worst
    return (f"; as run in {drift.dtype} the drift from float64 stays within {drift.drifts[i] / drift.bounds[i]:.2g}x "
            f"its value at the first positions ({drift.base:.2g})")
