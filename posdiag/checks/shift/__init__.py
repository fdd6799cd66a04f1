"""shift — relative invariance: add k to every position; a relative model must not notice.

RoPE scores depend on the offset only, <R_(m+k) q, R_(n+k) k> = <R_m q, R_n k>, so position_ids + k
must leave every output unchanged for any k (ALiBi and T5 buckets likewise: a constant added to a row
of scores cancels in the softmax). A q-only rotation, q and k paired in different layouts, or a
position used absolutely anywhere breaks it at the first rung. In floating point the invariance is
approximate: the angle m·θ carries a rounding error of about m·θ·eps, i.e. a position error of about
m·eps in every pair. So the tolerance at rung k grows with the largest position P_k = k + T - 1:

    error(k) = ||f(x, pos + k) - f(x, pos)|| / ||f(x, pos)||
    tolerance(k) = FAIL_RATIO · (floor + Δ1 · eps · (P_k + 1))

where Δ1 is the measured output change for a one-position change of the relative offsets (half the
tokens moved one step further away: the model's sensitivity to a position error of 1), eps the
machine epsilon of the dtype the check runs in, and floor the rounding floor measured in the same
run (a consistent permutation, as in `shuffle`). The ladder k = 1, 2, 4, ... up to the declared
context minus T runs in one forward; the first k past its tolerance is where invariance breaks.

Families that derive positions inside (ALiBi, T5, BART, Marian take no position_ids) are shifted by
a prefix instead: k padding tokens, invisible to every query, placed before the probe. Absolute
positions (learned or sinusoidal tables) are not meant to be invariant: the check reports how much
the outputs change and SKIPs. A model that declares relative positions whose one-position change Δ1
stays within FAIL_RATIO noise floors FAILs: its positions move nothing, so invariance would hold
trivially (in half precision that is inconclusive, WARN). Stateful rope types (dynamic, longrope) choose
frequencies from the largest position in the batch; the whole ladder shares one forward, so one set of frequencies.

Recurrent / linear-attention / convolutional mixers (posdiag.model.introspect) never see position ids, so the
direct route stays faithful for them (the ids move, the recurrence does not care); only the floor changes:
no consistent permutation exists, so the baseline repeated with its token embeddings jittered by ~1 ulp
(see `positions`) gives it. The prefix route is not run for them: an explicit 4D mask hides the prefix
from attention only, the recurrence still reads it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from posdiag.checks import CheckSpec, Option
from posdiag.checks.shift import as_run, judge, ladder
from posdiag.checks.shift.judge import ABSOLUTE_KINDS, RELATIVE_KINDS
from posdiag.model.casts import Angles, float64_angles
from posdiag.model.introspect import recurrent_mixers
from posdiag.model.precision import run_finer
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, release_freed_memory
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, combine_stacks
from posdiag.verdict import LOW_PRECISION, above_rounding, stack_result

SPEC = CheckSpec("shift", "Relative invariance under a position shift",
                 "relative positions (RoPE, ALiBi, T5 buckets) give the same outputs when every position moves by k",
                 options={"max_shift": Option(None, "largest k; default: the declared context less the probe", (int,))})


def run(subject: Subject, options: RunOptions) -> CheckResult:
    kind = subject.position_kind
    if kind not in RELATIVE_KINDS + ABSOLUTE_KINDS:
        recurrent = recurrent_mixers(subject.language_model)
        why = (f"; order enters through {subject.family.name}'s recurrent sequence mixers ({', '.join(recurrent)}), "
               f"which read no position ids") if recurrent else ""
        return SPEC.result(Status.NA, f"no position mechanism found ({kind}): nothing to shift{why}")
    with subject.absolute_term_held() as held:  # an absolute-by-design term held constant: the rest is judged
        result = _decided_in_float64(subject, options) if subject.dtype_name in LOW_PRECISION else \
            _stacks(subject, options)
    return judge.with_term_held(subject, result, held) if held else result


def _stacks(subject: Subject, options: RunOptions, angles: Angles | None = None,
            kept: dict[str, as_run.Finer] | None = None) -> CheckResult:
    return combine_stacks(SPEC.name, [stack_result(SPEC.name, stack,
                                                   lambda s=stack: _run_stack(subject, options, s, angles, kept))
                                      for stack in subject.stacks])


def _decided_in_float64(subject: Subject, options: RunOptions) -> CheckResult:
    """In bf16/fp16 the angle-rounding bound is larger than a whole unit shift of an absolute model, so a run
    there cannot decide (a real absolute-position leak passed under --no-upcast): the ladder runs with the
    model in float64, module by module, and is judged there. The float64 run keeps no float32 inside
    (posdiag.model.casts): norms, softmax and the rotary angles m·θ run in float64; a rotary table stored in float32
    keeps its rounding, and the rung's bound then takes float32's epsilon. Float64 also removes what exists only in
    the dtype as run, so the same rows run again as users run them and each rung's drift from float64 is judged
    (as_run.py). Only when no float64 run is possible does the half-precision run speak, saying so."""
    half = subject.dtype
    kept: dict[str, as_run.Finer] = {}

    def in_float64() -> CheckResult:
        subject.dtype = torch.float64  # masks and rounding bounds of the run that decides
        try:
            with float64_angles(subject.model) as angles:
                return _stacks(subject, options, angles, kept)
        finally:
            subject.dtype = half

    finer = run_finer(subject, in_float64, what="shift ladder")
    release_freed_memory()
    name = dtype_name(half)
    if finer.value is None:
        result = _stacks(subject, options)
        return replace(result, summary=f"{result.summary} (in {name}; the float64 run that decides could not run: "
                                       f"{finer.reason})")
    result = finer.value
    result = replace(result, summary=f"{result.summary} (decided in {dtype_name(finer.dtype)}: a {name} run cannot "
                                     f"tell a position leak from its own rounding)",
                     details={**result.details, "decided_in": dtype_name(finer.dtype), "how": finer.how})
    return _judged_as_run(subject, options, result, kept)


def _judged_as_run(subject: Subject, options: RunOptions, result: CheckResult,
                   kept: dict[str, as_run.Finer]) -> CheckResult:
    """The float64 verdict, and what the dtype as run adds: a FAIL where it drifts from float64 further into the
    context than at its first positions."""
    for stack, finer in kept.items():
        drift = as_run.measure_drift(subject, stack, finer, options.seed)
        if drift is None:
            return SPEC.result(Status.FAIL, f"non-finite hidden states under shifted positions as run in "
                                            f"{subject.dtype_name} (finite in float64)", result.metrics,
                               {**result.details, "stack": stack})
        details = {**result.details, "as_run": {"dtype": drift.dtype, "stack": stack, "base_drift": drift.base,
                                                "drifts": drift.drifts, "bounds": drift.bounds}}
        metrics = {**result.metrics, "as_run_drift": drift.drifts[drift.worst],
                   "as_run_ratio": drift.drifts[drift.worst] / drift.bounds[drift.worst]}
        if drift.breaks is not None and result.status is not Status.FAIL:
            return replace(result, status=Status.FAIL, summary=f"{as_run.broken_summary(drift, finer.probe)} "
                                                               f"(float64: {result.summary})",
                           metrics=metrics, details=details)
        clause = as_run.held_clause(drift) if result.status is Status.PASS else ""
        result = replace(result, summary=result.summary + clause, metrics=metrics, details=details)
    return result


def _run_stack(subject: Subject, options: RunOptions, stack: str, angles: Angles | None = None,
               kept: dict[str, as_run.Finer] | None = None) -> CheckResult:
    """One stack: plan the ladder, measure it in one forward, judge each rung, report."""
    ok, why = subject.explicit_mask_supported
    if not ok:
        return SPEC.result(Status.SKIP, f"cannot hand the model an explicit mask: {why}", details={"stack": stack})
    planned = ladder.plan(subject, options, options.for_check(SPEC.name).get("max_shift"))
    if isinstance(planned, str):
        return SPEC.result(Status.SKIP, planned, details={"stack": stack})
    probe = ladder.build(subject, options, stack, planned)
    details: dict[str, Any] = {"stack": stack, "route": "prefix of invisible padding" if probe.prefix
                               else "position_ids + k", "seq_len": probe.span, "ladder": probe.ladder}
    measured = ladder.measure(subject, probe, stack, options.seed)
    if measured is None:
        return SPEC.result(Status.FAIL, "non-finite hidden states under shifted positions", {}, details)
    if kept is not None:
        kept[stack] = as_run.Finer(probe, measured.out.final, measured.delta1)
    if measured.recurrent_mixers:
        details["recurrent_mixers"] = measured.recurrent_mixers
    details["floor_source"] = measured.floor_source
    judged = judge.judge(subject, probe, measured, angles)
    if angles is not None and angles.kept:
        details["rotary_tables_kept"] = {name: dtype_name(angles.tables.get(name, torch.float32))
                                         for name in angles.kept}
    metrics: dict[str, Any] = {"noise_floor": judged.floor, "unit_shift_effect": measured.delta1, "eps": judged.eps}
    unfaithful = judge.mask_unfaithful(subject, probe, measured, stack, judged.floor, metrics)
    if unfaithful:
        return SPEC.result(Status.SKIP, unfaithful, metrics, details)
    return _report(subject, stack, probe, measured, judged, metrics, details)


def _report(subject: Subject, stack: str, probe: ladder.Probe, measured: ladder.Measured, judged: judge.Judged,
            metrics: dict[str, Any], details: dict[str, Any]) -> CheckResult:
    """The ladder's figures, where it breaks, and the verdict that applies to this position kind."""
    table = (judge.ladder_table(subject, stack, probe, measured, judged),)
    w = judged.worst
    details["errors"] = measured.errors[-1]
    details["tolerances"] = judged.tolerance
    metrics.update({"error": measured.errors[-1][w], "tolerance": judged.tolerance[w], "ratio": judged.ratio[w],
                    "worst_shift": probe.ladder[w], "max_shift": probe.ladder[-1]})
    metrics["unit_shift_ratio"] = judged.signal
    if not above_rounding(judged.signal):
        status, summary = judge.no_position_effect(subject, stack, probe, measured, judged, details)
        return SPEC.result(status, summary, metrics, details, table)
    if judged.breaks is not None:
        judge.locate_break(subject, probe, measured, judged, stack, details)
        metrics["breaks_at"] = details["breaks_at"]
    if subject.position_kind in ABSOLUTE_KINDS:
        status, summary = judge.absolute(subject, probe, measured, judged)
        return SPEC.result(status, summary, metrics, details, table)
    if judged.breaks is not None and subject.family.absolute_by_design and not subject.held_absolute:
        details["absolute_by_design"] = subject.family.absolute_by_design
        return SPEC.result(Status.NA, judge.by_design(subject, probe, measured, judged), metrics, details, table)
    if judged.breaks is not None:
        return SPEC.result(Status.FAIL, judge.broken(probe, measured, judged, details), metrics, details, table)
    return SPEC.result(Status.PASS, judge.invariant(probe, measured, judged), metrics, details, table)
