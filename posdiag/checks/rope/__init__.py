"""rope — does the model apply the rotation its config describes, at every position it claims?

Two probes against a float64 reference built from the config (frequencies from transformers'
own ROPE_INIT_FUNCTIONS, angles p·θ_i in float64), at positions spread over
[0, max(target, declared context)] in one forward (two for dynamic/longrope, one on each side of
their switch point):
1. tables: each rotary module's cos/sin, layout (rotate-half, interleaved, compact) fitted.
2. applied rotation: every position holds the same token, so every layer's pre-rotation q/k are
   the same vector u at every position (values are identical, so attention averages identical
   vectors). The q/k that reach attention (captured from the eager attention function, or the
   apply function's output) must then satisfy q(p) = R_p q(0) pair by pair, with the untouched
   dims unchanged: wrong pairing, partial-dim mistakes, q/k layout mismatch, a key never rotated
   show here even when tables look right. Math: R_p rotates pair (a_i, b_i) by p·θ_i. A model that rotates
   by -p·θ_i (NanoChat) in q and k alike is relative too (<R_-m q, R_-n k> = <q, R_(m-n) k>) and passes, the
   direction named in the summary; q and k rotated in opposite directions fail. Behind a recurrent mixer the
   premise fails (the attention layer's input differs per position): there each rotated q/k is judged against
   the un-rotated q/k of the same apply_rotary_pos_emb call, rotated(p) = R_p unrotated(p) (paired.py).
3. attention factor (YaRN/longrope "mscale"): q(p) = s·R_p u scales every position alike, so probe 2
   cannot see s, and nor can anything else observed after the rotation (weights scaled by s are the
   same model). It is measured against the un-rotated q/k of the same forward (the inputs of
   apply_rotary_pos_emb, else the q_proj/k_proj outputs of an attention without norms between
   projection and rotation): a rotation keeps each pair's norm, so ||rotated dims|| / ||un-rotated
   dims|| = s at every position, 0 included, and must equal transformers' attention_scaling.
The tolerance per element is what an honest implementation carries (float32 angles, output
rounding) plus the measured spread of the layer inputs across positions (the noise floor of the
same-token premise); FAIL above FAIL_RATIO times it, or on non-finite values. The attention factor's
tolerance is the rounding bound of one honest rotation (a few units of the dtype relative to s):
PASS within it, WARN up to FAIL_RATIO times it (inconclusive), FAIL above.

Where each lives: planning.py (positions, per-layer specs), tables.py (probe 1), capture.py (observing
q/k), applied.py (probe 2), paired.py (probe 2's un-rotated q/k for recurrent models), factor.py (probe 3),
findings.py (`Finding`), report.py (tables, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posdiag.checks import CheckSpec, Option
from posdiag.checks.rope.applied import probe_applied
from posdiag.checks.rope.factor import FactorSummary, factor_summary
from posdiag.checks.rope.findings import Finding, severity
from posdiag.checks.rope.grid import probe_grid
from posdiag.checks.rope.planning import Plan, make_plan, restored_rotary_state
from posdiag.checks.rope.report import (
    factor_table,
    position_table,
    section_table,
    section_words,
    spec_dict,
    static_metrics,
    static_table,
)
from posdiag.checks.rope.tables import probe_tables
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, Table
from posdiag.tools import rope_math
from posdiag.verdict import FAIL_RATIO

SPEC = CheckSpec(
    name="rope",
    title="RoPE frequencies and applied rotation",
    proves="q and k are rotated as the config's frequencies say, at every position up to the target length",
    options={
        "target_length": Option(None, "the longest position probed; by default the declared context (a longer one "
                                      "checks that extension reaches it)", (int,)),
    },
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    specs, skip = _specs_or_skip(subject)
    if skip:  # a model without RoPE: the check does not apply; the other reasons are what posdiag cannot probe
        return SPEC.result(Status.NA if subject.position_kind != "rope" else Status.SKIP, skip)
    plan = make_plan(subject, options.for_check(SPEC.name), specs)
    token = int(subject.sample_ids(1, 1, options.seed)[0, 0])
    seen = _observe(subject, specs, plan, token, options.seed)
    factor = factor_summary(seen.factors, [r.attention_scaling for r in plan.static], subject.dtype_name)
    metrics, details = _evidence(plan, seen, factor)
    status, summary = _verdict(specs, plan, seen, factor, metrics["max_position"])
    return SPEC.result(status, summary, metrics, details, _tables(plan, seen))


def _specs_or_skip(subject: Subject) -> tuple[list[rope_math.RopeSpec], str]:
    """The config's rope specs, or why this model cannot be probed (a SKIP reason)."""
    if subject.position_kind != "rope":
        return [], f"not a RoPE model (positions: {subject.position_kind})"
    if not subject.is_hf:
        return [], "factory model without a transformers config: no RoPE parameters to compare against"
    specs = rope_math.rope_specs(subject.config)
    if not specs:
        return [], "RoPE model, but the config gives no rope parameters to build a reference from"
    if subject.kind == "seq2seq":
        return [], "encoder-decoder RoPE models are not probed yet"
    try:
        for s in specs:
            rope_math.inv_freq(subject.config, s)
    except Exception as exc:
        return [], f"cannot build the reference frequencies: {exc}"[:300]
    return specs, ""


@dataclass
class _Observed:
    findings: list[Finding] = field(default_factory=list)
    probe_rows: list[tuple] = field(default_factory=list)  # (probe label, position, worst ratio)
    factors: list[Finding] = field(default_factory=list)
    table_done: bool = False
    applied_done: bool = False
    why_not_applied: str = ""
    not_probed: list[str] = field(default_factory=list)  # what could not be probed, and why (each once)
    no_factor: list[str] = field(default_factory=list)  # "layer L q" whose attention factor was not measured
    streams: list[str] = field(default_factory=list)  # mRoPE probes with differing t/h/w streams that ran

    def skipped(self, reasons: list[str]) -> None:
        self.not_probed += [r for r in reasons if r not in self.not_probed]


def _observe(subject: Subject, specs: list[rope_math.RopeSpec], plan: Plan, token: int, seed: int) -> _Observed:
    """Both probes at each plan's positions, the reference frequencies built for that plan's length."""
    seen = _Observed()
    with restored_rotary_state(subject.model):
        for label, positions in plan.probes:
            refs = {id(s): rope_math.inv_freq(subject.config, s, seq_len=int(positions.max()) + 1) for s in specs}
            t_find, t_done, t_skipped = probe_tables(subject, specs, refs, positions)
            seen.findings += [f.labelled(label) for f in t_find]
            seen.table_done |= t_done
            seen.skipped(t_skipped)
            applied = probe_applied(subject, plan.layer_spec, refs, positions, token)
            seen.skipped([f"layer {layer} (no RoPE by design: {reason})" for layer, reason in applied.nope.items()])
            seen.no_factor += [n for n in applied.no_factor if n not in seen.no_factor]
            seen.findings += [f.labelled(label) for f in applied.findings]
            seen.factors += applied.factors
            seen.probe_rows += [(label, *r) for r in applied.rows]
            seen.applied_done |= applied.observed
            seen.why_not_applied = seen.why_not_applied or applied.why_not
        if seen.applied_done:  # multimodal RoPE: the streams apart (probe 4), at the last plan's positions
            label, positions = plan.probes[-1]
            refs = {id(s): rope_math.inv_freq(subject.config, s, seq_len=int(positions.max()) + 1) for s in specs}
            g_find, seen.streams, why = probe_grid(subject, plan.layer_spec, refs, positions, token, seed)
            seen.findings += g_find
            seen.skipped([why] if why else [])
    if seen.factors and seen.no_factor:  # measured at some layers only (none at all: factor_summary says so)
        seen.skipped([f"attention factor at {', '.join(seen.no_factor)}: no un-rotated q/k lined up with the "
                      "rotated one"])
    if seen.why_not_applied and not seen.applied_done:
        seen.skipped([f"applied rotation: {seen.why_not_applied}"])
    return seen


def _evidence(plan: Plan, seen: _Observed, factor: FactorSummary) -> tuple[dict[str, Any], dict[str, Any]]:
    """The metrics and details: the static analysis, what was probed, the attention factor, the worst finding."""
    metrics: dict[str, Any] = {
        "target_length": plan.target, "declared_context": plan.declared,
        "positions_probed": int(sum(len(p) for _, p in plan.probes)),
        "max_position": int(max(int(p.max()) for _, p in plan.probes)), "probes": len(plan.probes),
        "tables_probed": seen.table_done, "applied_probed": seen.applied_done, "fail_ratio": FAIL_RATIO,
        "mrope_streams_probed": list(seen.streams),
        **static_metrics(plan.static),
    }
    details: dict[str, Any] = {
        "specs": [spec_dict(r) for r in plan.static], "warnings": [w for r in plan.static for w in r.warnings],
        "notes": plan.notes + [n for r in plan.static for n in r.notes],
        "error_by_position": [[label, int(p), float(r)] for label, p, r in seen.probe_rows],
    }
    metrics.update(factor.metrics)
    details["attention_factor"] = factor.rows
    details["not_probed"] = list(seen.not_probed)
    if factor.note:
        details["notes"].append(factor.note)
    worst = max(seen.findings, key=severity, default=None)
    if worst is not None:
        metrics.update(worst.metrics())
        details["worst"] = worst.where()
        details["failures"] = [f.where() for f in sorted(seen.findings, key=severity, reverse=True)[:8] if f.failed]
    return metrics, details


def _verdict(specs: list[rope_math.RopeSpec], plan: Plan, seen: _Observed, factor: FactorSummary,
             max_position: int) -> tuple[Status, str]:
    status, summary = _judged(specs, plan, seen, factor, max_position)
    if seen.not_probed and status in (Status.PASS, Status.WARN):
        summary += f"; not probed: {'; '.join(seen.not_probed)}"
    return status, summary


def _judged(specs: list[rope_math.RopeSpec], plan: Plan, seen: _Observed, factor: FactorSummary,
            max_position: int) -> tuple[Status, str]:
    if not seen.table_done and not seen.applied_done:
        return Status.SKIP, f"could not observe the rotation: {'; '.join(seen.not_probed) or 'no rotary module found'}"
    failed = [f for f in seen.findings if f.failed]
    if failed:
        return Status.FAIL, max(failed, key=severity).sentence()
    worst = max(seen.findings, key=severity, default=None)
    ratio = f"worst {worst.ratio:.3g}x tolerance" if worst else "no comparison"
    if not seen.applied_done:
        return Status.WARN, f"tables match the config ({ratio}) but the applied rotation could not be observed"
    if factor.warning:
        return Status.WARN, f"rotation agrees with the config ({ratio}); {factor.warning}"
    warnings = [w for r in plan.static for w in r.warnings]
    if warnings:
        return Status.WARN, f"module agrees with the config ({ratio}); {warnings[0]}"
    spec_text = ", ".join(f"{s.rope_type} θ={s.theta:g}" + (f" ({s.layer_type})" if s.layer_type else "")
                          for s in specs)
    bounds = section_words(plan.static)
    streams = (f", mRoPE sections ({bounds}) with distinct t/h/w streams ({', '.join(seen.streams)})" if seen.streams
               and bounds else f", mRoPE sections with distinct t/h/w streams ({', '.join(seen.streams)})"
               if seen.streams else "")
    if any(str(f.extra.get("layout", "")).endswith("reversed") for f in seen.findings):
        streams += ", rotating by -p·θ in q and k alike"
    nope = [str(i) for i, s in enumerate(plan.layer_spec) if s is None]
    if nope:
        which = f"layers {', '.join(nope)} rotate" if len(nope) > 1 else f"layer {nope[0]} rotates"
        streams += f"; NoPE {which} nothing, as the config says"
    return Status.PASS, (f"applied rotation matches the config ({spec_text}{streams}) up to position {max_position}: "
                         f"{ratio}{factor.clause}")


def _tables(plan: Plan, seen: _Observed) -> tuple[Table, ...]:
    tables = [static_table(plan.static)]
    sections = section_table(plan.static)
    if sections is not None:
        tables.append(sections)
    if seen.probe_rows:
        tables.append(position_table(seen.probe_rows))
    if seen.factors:
        tables.append(factor_table(seen.factors))
    return tuple(tables)
