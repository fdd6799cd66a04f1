"""The one rule for judging an equivariance residual against its noise floor.

A model without positions gives a residual at floating-point rounding; a model with
positions gives a residual far above it, however weak its position signal. So the
residual is judged as a ratio to a floor measured in the same run (the *consistent*
permutation, which must reproduce P f(x) exactly in exact arithmetic), never against a
fixed threshold: tiny default-init models have residuals near 1e-2 (Llama) or 5e-5
(ModernBERT), and both are healthy.
"""

from __future__ import annotations

from dataclasses import dataclass

from posdiag.results import Status

# Machine epsilon per dtype. The floor is never taken below one unit of the dtype the
# comparison ran in: a floor of exactly 0 (a bitwise-identical consistent run) would
# make any rounding difference look infinitely large.
MACHINE_EPSILON = {
    "float64": 1.1e-16,
    "float32": 1.2e-7,
    "bfloat16": 7.8e-3,
    "float16": 9.8e-4,
}

# A residual below FAIL_RATIO floors is indistinguishable from reordering the sums: the
# model is permutation-equivariant. Above PASS_RATIO, position clearly entered. Between
# them the signal exists but is too weak to call: WARN. A model without positions
# measures a ratio of ~0.3-3 (same rounding, different order), so 10 leaves a margin of
# several times on the failing side; 100 keeps the weakest healthy default-init families
# (ModernBERT ~5e-5 against 1e-7) a factor of 5 above the band.
FAIL_RATIO = 10.0
PASS_RATIO = 100.0

LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class FloorVerdict:
    status: Status
    residual: float
    noise_floor: float
    ratio: float
    reason: str


def noise_floor(measured: float, dtype: str) -> float:
    """The floor to divide by: the measured consistent residual, at least one machine epsilon."""
    return max(measured, MACHINE_EPSILON.get(dtype, 1.2e-7))


def judge_position_signal(residual: float, measured_floor: float, dtype: str) -> FloorVerdict:
    """Did position enter? PASS when the residual stands far above the floor.

    In bf16/fp16 a ratio below PASS_RATIO is *inconclusive* (WARN): a weak but real position
    signal is about the size of half-precision rounding, so "no positions" and "weak
    positions" cannot be told apart there. Only fp32/fp64 runs may FAIL.
    """
    floor = noise_floor(measured_floor, dtype)
    ratio = residual / floor
    if residual != residual:  # NaN
        return FloorVerdict(Status.FAIL, residual, floor, ratio, "non-finite outputs")
    if ratio >= PASS_RATIO:
        return FloorVerdict(Status.PASS, residual, floor, ratio, "position signal far above the noise floor")
    if dtype in LOW_PRECISION:
        return FloorVerdict(
            Status.WARN, residual, floor, ratio,
            f"inconclusive in {dtype}: residual within {PASS_RATIO:g}x of rounding; rerun in float32",
        )
    if ratio < FAIL_RATIO:
        return FloorVerdict(Status.FAIL, residual, floor, ratio, "outputs merely permute: position never entered")
    return FloorVerdict(
        Status.WARN, residual, floor, ratio,
        f"weak position signal: {ratio:.3g}x the noise floor (pass needs {PASS_RATIO:g}x)",
    )


# The bands as questions a check asks, so no check compares against FAIL_RATIO or PASS_RATIO itself. `bound` is a
# floor already taken (noise_floor) or a floor plus a predicted rounding term (shift's angle rounding); a NaN is
# never within a band and never clears one (each check judges non-finite values where it finds them).


def band_tolerance(bound: float):
    """The largest error the agreement band passes over `bound` (works on numpy arrays too)."""
    return FAIL_RATIO * bound


def within_tolerance(error: float, bound: float) -> bool:
    """Two computations agree: `error` is at most FAIL_RATIO times `bound`."""
    return error <= band_tolerance(bound)


def within_band(ratio: float) -> bool:
    """A ratio to its bound that the agreement band passes (at most FAIL_RATIO)."""
    return ratio <= FAIL_RATIO


def above_rounding(ratio: float) -> bool:
    """A ratio to the noise floor that reordering the sums cannot explain (at least FAIL_RATIO)."""
    return ratio >= FAIL_RATIO


def clear_signal(ratio: float) -> bool:
    """A ratio to the noise floor far enough above it to PASS a position signal (at least PASS_RATIO)."""
    return ratio >= PASS_RATIO


def agreement_tolerance(measured_floor: float, dtype: str) -> float:
    """The largest disagreement judge_agreement passes for this measured floor."""
    return FAIL_RATIO * noise_floor(measured_floor, dtype)


def judge_agreement(error: float, measured_floor: float, dtype: str, factor: float = FAIL_RATIO) -> FloorVerdict:
    """The mirror rule: two computations that must agree. FAIL when the error stands above the floor."""
    floor = noise_floor(measured_floor, dtype)
    ratio = error / floor
    if error != error:
        return FloorVerdict(Status.FAIL, error, floor, ratio, "non-finite outputs")
    if ratio <= factor:
        return FloorVerdict(Status.PASS, error, floor, ratio, "agrees within the noise floor")
    return FloorVerdict(Status.FAIL, error, floor, ratio, f"differs by {ratio:.3g}x the noise floor")


# Float64 arbitration. Rounding error scales with the unit of the dtype: float32 -> float64 shrinks it by
# ~1e9 (measured: a healthy hybrid's chunked cache continuation 4.4e-7 in float32, 0.0 in float64), while a bug
# stays (the buggy ones: 4.9e-2 in both). A disagreement that shrinks by SHRINK_RATIO or more, that passes the
# float64 floor rule, or that falls back within the run dtype's tolerance, was rounding; one that does none of
# these is a bug. 1e4 sits in the middle of the two (log scale).
SHRINK_RATIO = 1e4


def shrinks_with_precision(error: float, finer_error: float) -> bool:
    """The same comparison re-run in a finer dtype fell by SHRINK_RATIO or more: it was rounding."""
    return error >= SHRINK_RATIO * finer_error


def degenerate_floor(measured_floor: float, dtype: str) -> bool:
    """A floor of exactly 0 or below one unit of the run dtype is a bitwise-identical comparison, not a
    measurement of rounding: any difference elsewhere then looks infinitely large."""
    return not measured_floor >= MACHINE_EPSILON.get(dtype, 1.2e-7)


def needs_arbitration(verdict: FloorVerdict, measured_floor: float, dtype: str) -> bool:
    """Re-run both sides in float64 when the run-dtype verdict is not a pass (a pass needs no deciding: a
    degenerate floor only makes the tolerance stricter)."""
    return verdict.status is not Status.PASS


def judge_arbitrated(error: float, measured_floor: float, dtype: str, error64: float, floor64: float,
                     finer: str = "float64") -> FloorVerdict:
    """Decide a disagreement with the same comparison re-run in a finer dtype: rounding or a bug.

    The verdict carries the run-dtype figures (residual, floor, ratio); the reason names both."""
    floor = noise_floor(measured_floor, dtype)
    ratio = error / floor
    both = f"{error:.3g} in {dtype}, {error64:.3g} in {finer}"
    if error != error:
        return FloorVerdict(Status.FAIL, error, floor, ratio, f"{both}: non-finite outputs in {dtype}")
    if error64 != error64:
        return FloorVerdict(Status.FAIL, error, floor, ratio, f"{both}: non-finite outputs in {finer}")
    shrink = error / error64 if error64 > 0 else float("inf")
    # Back within the run dtype's own tolerance in float64: what is left is smaller than the rounding the run
    # dtype allows (code that casts to float32 inside keeps some: Falcon-H1's decode step, 2.6e-8 in float64).
    within = error64 <= agreement_tolerance(measured_floor, dtype)
    if judge_agreement(error64, floor64, finer).status is Status.PASS or shrink >= SHRINK_RATIO or within:
        return FloorVerdict(Status.PASS, error, floor, ratio, f"{both}: rounding (it shrinks with precision)")
    return FloorVerdict(Status.FAIL, error, floor, ratio, f"{both}: a bug (it does not shrink with precision)")
