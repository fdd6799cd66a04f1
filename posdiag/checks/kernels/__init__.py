"""kernels — every attention implementation must compute the same function as eager attention.

Tiled online-softmax attention (FlashAttention, SDPA) is exact in math: a running max m, a
running sum l, partial sums rescaled by exp(m_old − m_new). It differs from naive attention only
in summation order. So, with the same weights and inputs, each implementation's hidden states
must stay within rounding of a higher-precision eager reference (float64 on CPU when memory
allows, else float32), by FlashAttention's own rule:
    err(impl) <= 2 · err(eager in the run dtype) + atol,      err = ||h − h_ref|| / ||h_ref||
per layer, over valid (non-padding) positions, on three inputs: an unpadded batch (the model
builds no mask: the is_causal path), a left-padded batch (the mask handed to the kernel, fully
masked padding queries), and a chunk of several new tokens decoded against a KV cache (causal
alignment when q_len != k_len). NaN/Inf at valid positions fails; what a kernel writes at
padding queries is reported as information.

Layout: scenarios.py (what to compare), running.py (forwards, switching implementations, the
reference through posdiag.model.precision), isolated.py (an implementation in a child process),
judging.py (the rule and the verdict).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from posdiag.checks.kernels.isolated import ISOLATED, run_isolated
from posdiag.checks.kernels.judging import Evidence, judge, needs_arbitration
from posdiag.checks.kernels.running import finer_runs, forward, forward_all, reference_runs, run_here
from posdiag.checks.kernels.scenarios import COMPILED_EXTRAS, Run, Scenario, build_scenarios, default_implementations
from posdiag.checks.kernels.spec import SPEC
from posdiag.errors import describe_error
from posdiag.model.introspect import attention_free, recurrent_reason
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status


def run(subject: Subject, options: RunOptions) -> CheckResult:
    not_applicable = _not_applicable(subject)
    if not_applicable is not None:
        return not_applicable
    names, skipped = _implementations(subject, options.for_check("kernels"))
    scenarios = build_scenarios(subject, options)
    base_impl = subject.config._attn_implementation
    if base_impl not in (None, "eager"):
        return SPEC.result(Status.SKIP,
                           f"the model runs {base_impl}; load it with eager attention to compare")

    # Reference and the same-dtype eager baseline, the model as it is first. An input its own eager forward
    # cannot run (a cache path the model crashes on: `cache` judges that) has no baseline to compare kernels with.
    eager, scenarios, unrunnable = _eager_baseline(subject, scenarios)
    if not scenarios:
        return SPEC.result(Status.SKIP, f"the model's own eager forward raises on every input: "
                                                   f"{'; '.join(unrunnable)}")
    reference = reference_runs(subject, scenarios)
    if not reference.ran:
        return SPEC.result(Status.SKIP, f"{reference.reason}; FlashAttention's rule needs one")
    asked = bool(options.for_check("kernels").get("implementations"))
    runs, notes, refused = _run_implementations(subject, names, scenarios, skipped if not asked else None)
    evidence = Evidence(subject, scenarios, eager, reference.value, reference.dtype, reference.how,
                        {"eager": eager, **runs}, notes, skipped, not_applicable=refused)
    result = judge(evidence)
    # A layer where eager's error is a degenerate floor (below one unit of the run dtype) decides nothing:
    # the implementation re-run in the reference dtype does (rounding shrinks there, a bug stays).
    pending = needs_arbitration(result)
    if pending:
        evidence.finer = {n: None if n in ISOLATED else finer_runs(subject, n, scenarios, reference.dtype)
                          for n in pending}
        result = judge(evidence)
    if unrunnable:
        summary = f"{result.summary}; not compared (the model's own eager forward raises): {'; '.join(unrunnable)}"
        result = dataclasses.replace(result, summary=summary, details={**result.details, "not_compared": unrunnable})
    return result


def _eager_baseline(subject: Subject, scenarios: list[Scenario]) -> tuple[list[Run], list[Scenario], list[str]]:
    """(eager runs, the scenarios they ran on, 'input: exception' for each the model cannot run): every input at
    once (prefills shared), else each alone to tell which one the model cannot run."""
    try:
        return forward_all(subject, scenarios), scenarios, []
    except Exception:  # which input raised is found below, one at a time
        pass
    eager, kept, unrunnable = [], [], []
    for sc in scenarios:
        try:
            eager.append(forward(subject, sc))
            kept.append(sc)
        except Exception as exc:  # the model itself, not a kernel: no baseline on this input
            unrunnable.append(f"{sc.name} input ({describe_error(exc)})")
    return eager, kept, unrunnable


def _not_applicable(subject: Subject) -> CheckResult | None:
    if not subject.is_hf:
        return SPEC.result(Status.NA, "factory models have a single attention path: nothing to compare")
    if not hasattr(subject.model, "set_attn_implementation"):
        return SPEC.result(Status.SKIP, "the model cannot switch attention implementations")
    if attention_free(subject.language_model):
        return SPEC.result(Status.NA, f"{recurrent_reason(subject)}; and no layer is attention, so no "
                                                   "attention kernel runs: nothing to compare")
    return None


def _implementations(subject: Subject, settings: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(implementations to compare with eager, {implementation: why not run})."""
    names, skipped = default_implementations(subject)
    if settings.get("implementations"):
        names = [n for n in settings["implementations"] if n != "eager"]
        skipped = {}
    extra = subject.options.attn_implementation
    if extra not in ("eager", *names) and extra not in skipped:
        names.append(extra)
    return names, skipped


def _run_implementations(subject: Subject, names: list[str], scenarios: list[Scenario],
                         not_run: dict[str, str] | None = None
                         ) -> tuple[dict[str, list[Run | None] | str], dict[str, str], dict[str, dict[str, str]]]:
    """({implementation: its runs, or why it did not run}, {implementation: note}, {implementation: {input: why a
    pinned SDPA backend refused it}}); the note "crash" marks an implementation that crashed on these inputs: that is
    a finding. With `not_run` (the default set, nothing asked for), a COMPILED_EXTRAS implementation this machine cannot
    run (its compiler failing) goes there, as not run by default, instead of making the check a skip."""
    runs: dict[str, list[Run | None] | str] = {}
    notes: dict[str, str] = {}
    refused: dict[str, dict[str, str]] = {}
    for name in names:
        outcome = run_isolated(subject, name, scenarios) if name in ISOLATED else run_here(subject, name, scenarios)
        if not_run is not None and outcome.kind == "unavailable" and name in COMPILED_EXTRAS:
            not_run[name] = outcome.reason
            continue
        runs[name] = outcome.runs if outcome.runs is not None else outcome.reason
        if outcome.refused:
            refused[name] = outcome.refused
        if outcome.kind == "crashed":
            notes[name] = "crash"
        elif outcome.note:
            notes[name] = outcome.note
    return runs, notes, refused
