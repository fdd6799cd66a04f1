"""The shift ladder judged: each rung's error against FAIL_RATIO · (floor + Δ1 · eps · (P_k + 1)), the explicit
mask's fidelity before that, where a break sits, and the sentence each outcome reads as."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from posdiag.checks.shift.ladder import Measured, Probe, default_output, refine, worst_token
from posdiag.model.casts import Angles
from posdiag.model.inert import inert_reason
from posdiag.model.probe import fidelity_rows, judge_fidelity
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, layer_name, relative_l2
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    LOW_PRECISION,
    MACHINE_EPSILON,
    band_tolerance,
    clear_signal,
    noise_floor,
    within_band,
    within_tolerance,
)

RELATIVE_KINDS = ("rope", "alibi", "relative_bias")
ABSOLUTE_KINDS = ("learned", "sinusoidal")


@dataclass(frozen=True)
class Judged:
    """Every rung against its tolerance (final layer)."""

    floor: float  # the noise floor (at least one unit of the dtype)
    eps: float  # machine epsilon of the run dtype
    predicted: list[float]  # the rounding term Δ1 · eps · (P_k + 1) per rung
    tolerance: list[float]
    ratio: list[float]  # error / (floor + rounding term)
    breaks: int | None  # the first rung past its tolerance
    worst: int  # the rung with the largest ratio (NaN counts as the largest)
    signal: float  # Δ1 / floor: how far a one-position change stands above rounding


def judge(subject: Subject, probe: Probe, measured: Measured, angles: Angles | None = None) -> Judged:
    """`angles`: what a float64 run saw of the rotary angles. A table it could not recompute (GPT-J's sin/cos, built
    from float32 angles) keeps float32's angle rounding, so the rung's bound takes float32's epsilon; a table held
    in half precision (cast with a bfloat16 model) also carries that dtype's rounding of every sin/cos value, the
    same at every position: a term Δ1 · eps_table (the fastest pair turns by one radian per position, so an angle
    error of eps_table moves outputs about Δ1 · eps_table). Measured on the tiny GPT-J in bfloat16: error 9.9e-6
    at every rung, Δ1 · eps_table 1.0e-5."""
    dtype = subject.dtype_name
    floor = noise_floor(measured.measured_floor, dtype)
    eps = MACHINE_EPSILON.get(dtype, MACHINE_EPSILON["float32"])
    held = 0.0  # a rotary table's own rounding, the same at every position
    kept = angles.kept_dtype if angles is not None else None
    if kept is not None:
        eps = max(eps, MACHINE_EPSILON["float32"])  # the table was built from float32 angles
        held = MACHINE_EPSILON.get(dtype_name(kept), 0.0) if kept.itemsize < 4 else 0.0
    final = measured.errors[-1]
    # (P_k + 1) with P_k = k + span - 1
    predicted = [measured.delta1 * (eps * (k + probe.span) + held) for k in probe.ladder]
    ratio = [e / (floor + p) for e, p in zip(final, predicted, strict=True)]
    return Judged(floor=floor, eps=eps, predicted=predicted, tolerance=[band_tolerance(floor + p) for p in predicted],
                  ratio=ratio, breaks=next((i for i, r in enumerate(ratio) if not within_band(r)), None),
                  worst=max(range(len(ratio)), key=lambda i: ratio[i] if ratio[i] == ratio[i] else float("inf")),
                  signal=measured.delta1 / floor)


def mask_unfaithful(subject: Subject, probe: Probe, measured: Measured, stack: str, floor: float,
                    metrics: dict[str, Any]) -> str:
    """Why the explicit mask does not reproduce the model's own output ('' when it does): before any shifted
    row means anything. Its figures go into `metrics`."""
    default = default_output(subject, probe, stack, measured.encoder_ids)
    out = measured.out
    if probe.prefix:  # the base row is the probe followed by padding no query may see
        reproduces = relative_l2(out.hidden[-1][probe.base, :probe.span], default)
        metrics["mask_reproduces_default"] = reproduces
        if reproduces > band_tolerance(floor):
            return (f"padding in the explicit mask is not honoured: the padded probe does not reproduce the plain one "
                    f"(rel. error {reproduces:.2e})")
    elif stack == "decoder" and subject.kind != "encoder":
        fid = judge_fidelity(default, out.final[0], out.final[1], out.final[2], fidelity_rows(probe.rows[0].ids)[1],
                             measured.measured_floor, subject.dtype_name)
        metrics.update(fid.metrics())
        if not fid.ok:
            return f"mask not faithful, no verdict: {fid.reason}"
    else:
        reproduces = relative_l2(out.final[probe.base], default)
        metrics["mask_reproduces_default"] = reproduces
        if reproduces > band_tolerance(floor):
            return f"explicit mask does not reproduce the default output (rel. error {reproduces:.2e})"
    return ""


def ladder_table(subject: Subject, stack: str, probe: Probe, measured: Measured, judged: Judged) -> Table:
    return Table(
        f"error by offset ({stack})" if subject.kind == "seq2seq" else "error by offset",
        ("k", "max position", "error", "rounding term", "tolerance", "ratio", ""),
        tuple((k, k + probe.span - 1, f"{e:.3e}", f"{p:.2e}", f"{t:.2e}", f"{r:.3g}",
               "ok" if within_band(r) else "BREAKS")
              for k, e, p, t, r in zip(probe.ladder, measured.errors[-1], judged.predicted, judged.tolerance,
                                       judged.ratio, strict=True)),
    )


def locate_break(subject: Subject, probe: Probe, measured: Measured, judged: Judged, stack: str,
                 details: dict[str, Any]) -> int | None:
    """Where the broken rung shows first (layer, token) and, for a relative model, between which shifts it
    breaks (one more forward). -> the last shift that holds (None: not refined). Figures go into `details`."""
    i, layers = judged.breaks, len(measured.errors)
    k = probe.ladder[i]
    layer = next((l for l in range(layers)
                  if not within_tolerance(measured.errors[l][i], judged.floor + judged.predicted[i])), layers - 1)
    details.update({"first_layer": layer_name(layer, layers),
                    "worst_token": worst_token(measured.out, layers - 1, probe, i)})
    holds_up_to = None
    if i > 0 and subject.position_kind not in ABSOLUTE_KINDS:
        holds_up_to, k = refine(subject, probe, stack, measured.encoder_ids, probe.ladder[i - 1], k,
                                measured.delta1, judged.eps, judged.floor)
        details["refined_between"] = [probe.ladder[i - 1], probe.ladder[i]]
    details.update({"breaks_at": k, "holds_up_to": holds_up_to})
    return holds_up_to


def absolute(subject: Subject, probe: Probe, measured: Measured, judged: Judged) -> tuple[Status, str]:
    """Absolute tables are not meant to be invariant: judged against the noise floor, not the rounding term (that
    term models RoPE angle rounding, and in half precision it exceeds a whole unit shift of an absolute model)."""
    first, floor, kind = measured.errors[-1][0], judged.floor, subject.position_kind
    if not first > band_tolerance(floor):
        return Status.SKIP, (f"absolute positions ({kind}) yet a shift of {probe.ladder[0]} changes the outputs by "
                             f"only {first:.3g} ({first / floor:.3g}x the noise floor): are the position ids used?")
    return Status.NA, (f"absolute positions ({kind}): outputs change by {first:.3g} under a shift of {probe.ladder[0]} "
                       f"({first / floor:.3g}x the noise floor), as expected; relative invariance does not apply")


def by_design(subject: Subject, probe: Probe, measured: Measured, judged: Judged) -> str:
    """A relative family whose positions are absolute by design breaks, as it must: n/a, with the figures."""
    i = judged.breaks
    return (f"relative invariance does not apply: {subject.family.absolute_by_design}; a shift of {probe.ladder[i]} "
            f"moves the outputs {measured.errors[-1][i]:.3g} ({judged.ratio[i]:.3g}x floor + rounding term); the "
            f"rotation itself is judged by `rope`")


def with_term_held(subject: Subject, result: CheckResult, held: str) -> CheckResult:
    """A verdict reached with the family's absolute-by-design term held constant, saying so by name: a break is then
    relative (a FAIL stands), and a PASS covers what is relative only."""
    if result.status not in (Status.PASS, Status.WARN, Status.FAIL):
        return result
    clause = f"{subject.family.absolute_by_design}: absolute by design, so judged with it {held}"
    return replace(result, summary=f"{result.summary}; {clause}",
                   details={**result.details, "absolute_by_design": subject.family.absolute_by_design,
                            "absolute_held": held})


def broken(probe: Probe, measured: Measured, judged: Judged, details: dict[str, Any]) -> str:
    i, span = judged.breaks, probe.span
    k, holds_up_to = details["breaks_at"], details["holds_up_to"]
    where = (f"at shift {k} (max position {k + span - 1})" if holds_up_to is None else
             f"between shift {holds_up_to} and {k} (max position {holds_up_to + span - 1} holds, {k + span - 1} "
             "breaks)")
    return (f"relative invariance breaks {where}: at shift {probe.ladder[i]} error {measured.errors[-1][i]:.3g} = "
            f"{judged.ratio[i]:.3g}x (floor {judged.floor:.2g} + rounding term {judged.predicted[i]:.2g}), first in "
            f"{details['first_layer']}, worst at token {details['worst_token']}")


def invariant(probe: Probe, measured: Measured, judged: Judged) -> str:
    w, top = judged.worst, probe.ladder[-1]
    summary = (f"invariant under shifts up to {top} (max position {top + probe.span - 1}): worst error "
               f"{measured.errors[-1][w]:.3g} = {judged.ratio[w]:.3g}x (floor + rounding term) at shift "
               f"{probe.ladder[w]}; a one-position change moves outputs {measured.delta1:.3g} ({len(probe.ladder)} "
               f"shifts, {probe.span} tokens)")
    if not clear_signal(judged.signal):
        summary += f"; weak position signal ({judged.signal:.3g}x the floor): only breaks larger than that would show"
    return summary


def no_position_effect(subject: Subject, stack: str, probe: Probe, measured: Measured, judged: Judged,
                       details: dict[str, Any]) -> tuple[Status, str]:
    """Moving half the tokens one position further changed nothing measurable. For a model that declares
    relative positions that is the bug itself (an identity rotation, position ids ignored, a zeroed
    bias): invariance holds trivially, so a PASS or a SKIP would hide it. Absolute models keep the SKIP
    (their positions are judged by `shuffle` and `table`); a half-precision run cannot tell a weak
    signal from none (WARN, naming the float32 run that would decide); outputs that cannot carry positions
    at all (tokens that never interact, equal attention scores: `posdiag.model.inert`) SKIP, saying so."""
    kind, dtype = subject.position_kind, subject.dtype_name
    moved = ("the second half of the probe one position further away" if not probe.prefix
             else "the second half of the probe one padding slot further away")
    measured_text = (f"moving {moved} changes the outputs by only {measured.delta1:.2e} ({judged.signal:.3g}x the "
                     "noise floor)")
    details["position_effect"] = "none measurable"
    if kind in ABSOLUTE_KINDS:
        return Status.SKIP, f"{measured_text}: positions have no measurable effect, so invariance would say nothing"
    if dtype in LOW_PRECISION:
        return Status.WARN, (f"inconclusive in {dtype}: {measured_text}, within half-precision rounding of the {kind} "
                             "position signal; rerun in float32 (without --no-upcast) to decide whether positions "
                             "enter")
    if inert := inert_reason(subject, stack, probe.rows[probe.base].ids[:probe.span]):
        details["inert"] = inert
        return Status.SKIP, f"no verdict: {inert} ({measured_text})"
    return Status.FAIL, (f"positions move nothing: the model declares {kind} positions, yet {measured_text}; relative "
                         "offsets never reach attention (an identity rotation, position ids ignored, a zeroed bias), "
                         "so shift invariance would hold trivially")
