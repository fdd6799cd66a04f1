"""The one rule for judging an equivariance residual against its noise floor.

A model without positions gives a residual at floating-point rounding; a model with
positions gives a residual far above it, however weak its position signal. So the
residual is judged as a ratio to a floor measured in the same run (the *consistent*
permutation, which must reproduce P f(x) exactly in exact arithmetic), never against a
fixed threshold: tiny default-init models have residuals near 1e-2 (Llama) or 5e-5
(ModernBERT), and both are healthy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from posdiag.errors import MaskRefused
from posdiag.results import CheckResult, Status

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


# Power: could this PASS have failed? An agreement path proves something only where a position bug on that very path
# would have stood above its tolerance in the same run. The smallest such bug is a one-position slip at the path's
# boundary (a continuation numbered one early, a prefix hit one slot off, a chunk restarted one short): posdiag plants
# it itself, runs the same path in the same dtype against the same reference and floor, and reads its ratio. A slip
# the band would pass means the path's PASS could not have failed: inconclusive (WARN), never PASS. Measured on the
# real SmolLM2 stored in bfloat16: a chunked prefill one position early moves the logits by 7.2-7.7 yet measured
# 0.376x a bfloat16 floor of 0.16, so a PASS there claimed power it never had.


def slip_detectable(slip_error: float, measured_floor: float, dtype: str) -> bool:
    """A one-position slip on a path, measured like the path itself, stands above the agreement tolerance (a
    non-finite slip counts: the band would FAIL it)."""
    return not within_tolerance(slip_error, noise_floor(measured_floor, dtype))


def with_power(verdict: FloorVerdict, slip_error: float | None, measured_floor: float, dtype: str,
               path: str = "this path") -> FloorVerdict:
    """A PASS whose one-position slip (its error `slip_error`, measured in `dtype` against `measured_floor`) the band
    would also pass becomes a WARN naming the dtype and the slip's ratio; any other verdict, or a path whose slip
    could not be planted (None), stands as it is."""
    if verdict.status is not Status.PASS or slip_error is None or slip_detectable(slip_error, measured_floor, dtype):
        return verdict
    floor = noise_floor(measured_floor, dtype)
    return FloorVerdict(
        Status.WARN, verdict.residual, verdict.noise_floor, verdict.ratio,
        f"inconclusive in {dtype}: a one-position slip on {path} measures {slip_error:.3g} = {slip_error / floor:.3g}x "
        f"the noise floor {floor:.2g}, within the {FAIL_RATIO:g}x tolerance, so this agreement could not have failed; "
        f"rerun in float32 (--dtype float32) to decide")


def powered(verdicts: dict[str, FloorVerdict], slip_error: float | None, measured_floor: float, dtype: str,
            finer_decided: bool, path: str) -> tuple[dict[str, FloorVerdict], str]:
    """Every PASS checked for power in the dtype that decided it, and the clause a summary carries. Where a float64
    re-run decided (always in half precision), its floor resolves a slip and the verdicts stand; where the run dtype
    decided in half precision, a PASS whose slip the band would pass is a WARN (with_power). In float32 the slip's
    ratio is reported: one within the band there means the path reads no position from position_ids (ALiBi, a
    model without positions), which is not a precision's blindness."""
    if slip_error is None:
        return verdicts, ""
    floor = noise_floor(measured_floor, dtype)
    ratio = slip_error / floor
    clause = f"a one-position slip on {path}: {ratio:.3g}x the {dtype} floor"
    if finer_decided and not slip_detectable(slip_error, measured_floor, dtype):
        return verdicts, f"{clause}, which {dtype} alone could not resolve: decided in float64"
    if dtype not in LOW_PRECISION or finer_decided:
        return verdicts, clause
    return {name: with_power(v, slip_error, measured_floor, dtype, path) for name, v in verdicts.items()}, clause


# Float64 arbitration. Rounding error scales with the unit of the dtype: float32 -> float64 shrinks it by
# ~1e9 (measured: a healthy hybrid's chunked cache continuation 4.4e-7 in float32, 0.0 in float64), while a bug
# stays (the buggy ones: 4.9e-2 in both). A disagreement that shrinks by SHRINK_RATIO or more, that passes the
# float64 floor rule, or that falls back within the run dtype's tolerance, was rounding; one that does none of
# these is a bug. 1e4 sits in the middle of the two (log scale).
SHRINK_RATIO = 1e4


# Read as run: what a finer re-run calls rounding must have been rounding in the run dtype too. Rounding stays near
# its floor as run (healthy bfloat16 paths: at most 0.3x the floor in `batch` on tiny Llama and Qwen2, 0.06x in `cache`
# on the real SmolLM2; healthy kernels at most 1.26x their tolerance, ~2.5x eager's error, on SmolLM2 and Gemma 3),
# while a defect of the run dtype alone (the padding mask dropped on the half-precision path: 47x the bfloat16 floor,
# 1.8e-7 in float64) vanishes finer, where alone it would read as rounding. Twice the agreement band: `kernels`' rule
# (FAIL_RATIO x its tolerance of FACTOR = 2 x eager's error) in the same units.
AS_RUN_RATIO = 2 * FAIL_RATIO


def beyond_rounding_as_run(error: float, floor: float) -> bool:
    """An error the finer re-run calls rounding that stands AS_RUN_RATIO floors or more above the run dtype's floor: a
    bug of the run dtype only."""
    return error >= AS_RUN_RATIO * floor


def shrinks_with_precision(error: float, finer_error: float) -> bool:
    """The same comparison re-run in a finer dtype fell by SHRINK_RATIO or more: it was rounding."""
    return error >= SHRINK_RATIO * finer_error


def degenerate_floor(measured_floor: float, dtype: str) -> bool:
    """A floor of exactly 0 or below one unit of the run dtype is a bitwise-identical comparison, not a
    measurement of rounding: any difference elsewhere then looks infinitely large."""
    return not measured_floor >= MACHINE_EPSILON.get(dtype, 1.2e-7)


def needs_arbitration(verdict: FloorVerdict, measured_floor: float, dtype: str) -> bool:
    """Re-run both sides in float64 when the run-dtype verdict is not a pass (in float32 a pass needs no deciding: a
    degenerate floor only makes the tolerance stricter), and always in half precision: there the float64 re-run is
    read both ways (a bfloat16 floor is coarse enough to pass a one-position slip, which float64 shows as a bug), and
    it is what decides."""
    return verdict.status is not Status.PASS or dtype in LOW_PRECISION


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
    # dtype allows (code that casts to float32 inside keeps some: Falcon-H1's decode step, 2.6e-8 in float64). A
    # half-precision run allows no more than float32 does here: its own tolerance (a bfloat16 floor of 0.16 on the real
    # SmolLM2) would excuse a one-position slip (0.06) that float64 shows at full size.
    within = error64 <= (agreement_tolerance(0.0, "float32") if dtype in LOW_PRECISION
                         else agreement_tolerance(measured_floor, dtype))
    if judge_agreement(error64, floor64, finer).status is Status.PASS or shrink >= SHRINK_RATIO or within:
        if dtype in LOW_PRECISION and beyond_rounding_as_run(error, floor):
            return FloorVerdict(Status.FAIL, error, floor, ratio,
                                f"{both}: a bug in {dtype} only ({ratio:.3g}x the noise floor as run, beyond what "
                                f"rounding reaches; gone in {finer})")
        return FloorVerdict(Status.PASS, error, floor, ratio, f"{both}: rounding (it shrinks with precision)")
    return FloorVerdict(Status.FAIL, error, floor, ratio, f"{both}: a bug (it does not shrink with precision)")


def lost_in_run_dtype(verdict: FloorVerdict, finer_residual: float) -> bool:
    """A position signal that a finer run of the same rows shows far above the run dtype's own floor (so the run
    dtype could hold it), while the run dtype itself shows it within rounding: the dtype as run lost it (positions
    rounded before the angles, a position table underflowing). That is a bug of the model as users run it, not
    rounding: rounding leaves a signal that large standing (a healthy model's bfloat16 residual tracks float64's)."""
    return (verdict.status is not Status.PASS and verdict.residual == verdict.residual
            and clear_signal(finer_residual / verdict.noise_floor) and not above_rounding(verdict.ratio))


def judge_signal_decided(verdict: FloorVerdict, residual: float, floor: float, dtype: str, finer: str,
                         source: str) -> FloorVerdict:
    """A position signal the run dtype could not call, decided by the same rows re-run in `finer` (figures
    `residual`, `floor`). The verdict carries the finer figures; the reason names both runs. A signal lost only in
    the run dtype (lost_in_run_dtype) FAILs naming that dtype."""
    decided = judge_position_signal(residual, floor, finer)
    if dtype in LOW_PRECISION and lost_in_run_dtype(verdict, residual):
        return FloorVerdict(Status.FAIL, verdict.residual, verdict.noise_floor, verdict.ratio,
                            f"position signal lost in {dtype} only: {residual:.3g} in {finer} "
                            f"({residual / verdict.noise_floor:.3g}x the {dtype} floor, which {dtype} can hold) but "
                            f"{verdict.residual:.3g} = {verdict.ratio:.3g}x its floor as run in {dtype}: positions "
                            f"or a position table rounded in {dtype}")
    if not floor > 0 and shrinks_with_precision(verdict.residual, residual):
        # No floor measured in the finer run: the residual itself fell, so it was rounding.
        decided = FloorVerdict(Status.FAIL, residual, decided.noise_floor, decided.ratio,
                               f"outputs merely permute: the residual is rounding ({verdict.residual:.3g} in {dtype}, "
                               f"{residual:.3g} in {finer})")
    return FloorVerdict(decided.status, residual, decided.noise_floor, decided.ratio,
                        f"{decided.reason} in {finer} (inconclusive in {dtype}: {verdict.ratio:.3g}x its floor; "
                        f"{finer} floor: {source})")


# ------------------------------------------------------------------ float64 arbitration: the decision
# The re-run itself is model plumbing (posdiag.model.arbitration.arbitrate runs the measurement finer); what it
# decides, and what stands when it cannot run, is the rule here.
@dataclass
class Arbitration:
    """What a float64 re-run decided: new verdicts for the comparisons it re-judged, their figures, and the
    clause each summary carries ("1.7e-06 in float32, 3e-16 in float64: rounding")."""

    verdicts: dict[str, FloorVerdict] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def clause(self, name: str) -> str:
        verdict = self.verdicts.get(name)
        return f" ({verdict.reason})" if verdict is not None else ""


def arbitration_pending(verdicts: dict[str, FloorVerdict], measured_floor: float,
                        dtype: str) -> dict[str, FloorVerdict]:
    """The comparisons a float64 re-run must decide."""
    return {name: v for name, v in verdicts.items() if needs_arbitration(v, measured_floor, dtype)}


def unarbitrated(pending: dict[str, FloorVerdict], measured_floor: float, dtype: str, reason: str) -> Arbitration:
    """No float64 run was possible: the run-dtype verdict stands where its floor was a measurement; against a
    degenerate floor it becomes a WARN that names the float64 re-run that could not be made."""
    details = {"arbitration": {"ran": False, "reason": reason}}
    if not degenerate_floor(measured_floor, dtype):
        return Arbitration(details=details)
    why = f"the float64 re-run that decides could not run: {reason}"
    return Arbitration({name: FloorVerdict(Status.WARN, v.residual, v.noise_floor, v.ratio,
                                           f"inconclusive: {v.reason} against a degenerate floor; {why}")
                        for name, v in pending.items()}, details=details)


def arbitrated(pending: dict[str, FloorVerdict], measured_floor: float, dtype: str, floor64: float,
               errors64: dict[str, float], finer_name: str, how: str) -> Arbitration:
    """The pending comparisons decided by their errors re-measured in `finer_name` (floor `floor64`)."""
    # A finer run that is non-finite where the run dtype was finite did not compute the same thing (fully masked
    # rows in float64): it cannot decide, and the run-dtype verdict stands.
    unfaithful = sorted(n for n, v in pending.items() if errors64.get(n, 0.0) != errors64.get(n, 0.0)
                        and v.residual == v.residual)
    decided = {name: judge_arbitrated(v.residual, measured_floor, dtype, errors64[name], floor64, finer_name)
               for name, v in pending.items() if name in errors64 and name not in unfaithful}
    worst = max(decided, key=lambda n: errors64[n]) if decided else None
    metrics = {} if worst is None else {f"error_{finer_name}": errors64[worst],
                                        f"noise_floor_{finer_name}": noise_floor(floor64, finer_name)}
    details = {"arbitration": {"ran": True, "dtype": finer_name, "how": how, "floor": floor64,
                               "errors": {name: errors64[name] for name in decided},
                               "decided": {name: v.reason for name, v in decided.items()},
                               **({"non_finite_in_finer_run": unfaithful} if unfaithful else {})}}
    return Arbitration(decided, metrics, details)


def worst_error(errors: Iterable[float]) -> float:
    """The largest error, NaN if any is NaN (max() would skip it depending on order), 0.0 for none."""
    worst = 0.0
    for e in errors:
        if e != e:
            return float("nan")
        worst = max(worst, e)
    return worst


def stack_result(name: str, stack: str, judge: Callable[[], CheckResult]) -> CheckResult:
    """One stack's result. A stack whose model takes no form of the mask a probe needs is a SKIP that says
    so (MaskRefused), and the other stack of an encoder-decoder is still judged."""
    try:
        return judge()
    except MaskRefused as exc:
        return CheckResult(name, Status.SKIP, str(exc), details={"stack": stack, "mask_refused": str(exc)})
