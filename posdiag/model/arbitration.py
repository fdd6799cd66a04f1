"""Float64 arbitration run: a measurement whose verdict is not a pass is measured again with the model in float64.

The rule that decides (rounding shrinks by ~1e9 from float32 to float64, a bug does not) is verdict.py's; this is
the re-run that feeds it, through the one finer-dtype engine (posdiag.model.precision.run_finer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from posdiag.model.casts import float64_throughout
from posdiag.model.precision import run_finer
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, release_freed_memory
from posdiag.verdict import (
    Arbitration,
    FloorVerdict,
    arbitrated,
    arbitration_pending,
    judge_signal_decided,
    unarbitrated,
)

T = TypeVar("T")
AS_STORED_PASS = "the stored-dtype pass of a check decided in float32: read as run, no finer re-run"


def arbitrate(subject: Subject, measure: Callable[..., T], measured_floor: float, verdicts: dict[str, FloorVerdict],
              dtype: str, figures: Callable[[T], tuple[float, dict[str, float]]], *,
              subset: bool = False, reached: Callable[[T, torch.dtype], bool] | None = None,
              prefer: str | None = None) -> Arbitration:
    """Decide, don't shrug: comparisons that are above their tolerance, or judged against a degenerate floor,
    are measured again with `measure` re-run in float64 (the model converted module by module) and decided
    there: rounding shrinks by ~1e9, a bug does not. `figures(measurement) -> (floor, {name: error})`.
    With `subset`, `measure(names)` re-runs only the named comparisons (those that passed need no deciding).
    `reached(measurement, dtype)`: whether the re-run computed the same path (else run_finer tries the next
    conversion way), `prefer` the way to try first: generate's compiled forward, which the streamed ways' hooks push
    back to eager (a float64 re-run that ran eager would call a compiled-only bug rounding).

    When no float64 run is possible the run-dtype verdict stands where its floor was a measurement; against a
    degenerate floor it becomes a WARN that names the float64 re-run that could not be made."""
    pending = arbitration_pending(verdicts, measured_floor, dtype)
    if not pending:
        return Arbitration()
    if subject.as_stored_pass:  # the stored dtype's figures are read as run; the float32 run decided (half_precision)
        return Arbitration(details={"arbitration": {"ran": False, "reason": AS_STORED_PASS}})
    # Padding rows fully masked in float64 turn NaN and spread through 0-weight attention; the guard zeroes them
    # (a NaN in the run dtype is decided before this: judge_arbitrated never calls it rounding).
    finer = run_finer(subject, (lambda: measure(set(pending))) if subset else measure, what="re-run",
                      reached=reached, prefer=prefer)
    release_freed_memory()
    if finer.value is None:
        return unarbitrated(pending, measured_floor, dtype, finer.reason)
    floor64, errors64 = figures(finer.value)
    return arbitrated(pending, measured_floor, dtype, floor64, errors64, dtype_name(finer.dtype), finer.how)


def decide_signal(subject: Subject, verdict: FloorVerdict, measure: Callable[[], T],
                  figures: Callable[[T], tuple[float, float, str]], dtype: str) -> FloorVerdict:
    """A position signal between the bands, or with no usable floor: the same rows re-run with the model in float64
    (module by module, its float32 casts kept in float64: posdiag.model.casts) and decided there
    (verdict.judge_signal_decided). `figures(measurement) -> (residual, floor, floor source)`. Measured on Llamas
    without positions (8 and 64 layers x 256 hidden, 256 tokens): the residual falls from 4.6e-6 / 4.2e-5 in float32
    to ~1e-14, at its float64 floor; a position signal stays. When no finer run is possible the verdict stands,
    saying so."""
    if subject.as_stored_pass:
        return verdict

    def compute() -> T:
        with float64_throughout():
            return measure()

    finer = run_finer(subject, compute)
    release_freed_memory()
    if finer.value is None:
        return FloorVerdict(verdict.status, verdict.residual, verdict.noise_floor, verdict.ratio,
                            f"{verdict.reason}; the float64 re-run that decides could not run: {finer.reason}")
    residual, floor, source = figures(finer.value)
    return judge_signal_decided(verdict, residual, floor, dtype, dtype_name(finer.dtype), source)
