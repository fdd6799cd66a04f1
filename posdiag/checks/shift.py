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

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from posdiag.checks import CheckSpec, Option
from posdiag.model.inert import inert_reason
from posdiag.model.introspect import mixing_reason, recurrent_mixers
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.precision import run_finer
from posdiag.model.probe import Row, fidelity_rows, judge_fidelity, run_rows
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, layer_name, relative_l2, release_freed_memory
from posdiag.options import RunOptions, probe_length
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import FAIL_RATIO, LOW_PRECISION, MACHINE_EPSILON, PASS_RATIO, noise_floor, stack_result

SPEC = CheckSpec("shift", "Relative invariance under a position shift",
                 "relative positions (RoPE, ALiBi, T5 buckets) give the same outputs when every position moves by k",
                 options={"max_shift": Option(None, "largest k; default: the declared context less the probe", (int,))})

RELATIVE_KINDS = ("rope", "alibi", "relative_bias")
ABSOLUTE_KINDS = ("learned", "sinusoidal")
NO_CONTEXT_MAX_SHIFT = 4096  # direct route, when the config declares no context
PREFIX_MAX_SHIFT = 256  # prefix route: every row carries the longest prefix, so keep it bounded


@dataclass
class _Probe:
    """The rows of one stack and where each comparison reads them."""

    rows: list[Row]
    ladder: list[int]
    base: int  # row of the unshifted probe
    shifted: list[int]  # row of each rung
    gap: int  # row with the second half one position further away
    consistent: int | None  # row of the consistent permutation (floor), direct route only
    perm: torch.Tensor | None
    span: int  # tokens of the probe
    prefix: bool  # shifted by invisible padding tokens instead of position ids
    make_row: Callable[[int], Row]  # the probe shifted by k
    jitter: int | None = None  # row of the jittered baseline (floor), recurrent mixers only


def run(subject: Subject, options: RunOptions) -> CheckResult:
    kind = subject.position_kind
    if kind not in RELATIVE_KINDS + ABSOLUTE_KINDS:
        recurrent = recurrent_mixers(subject.language_model)
        why = (f"; order enters through {subject.family.name}'s recurrent sequence mixers ({', '.join(recurrent)}), "
               f"which read no position ids") if recurrent else ""
        return CheckResult("shift", Status.NA, f"no position mechanism found ({kind}): nothing to shift{why}")
    if subject.dtype_name in LOW_PRECISION:
        return _decided_in_float64(subject, options)
    return _stacks(subject, options)


def _stacks(subject: Subject, options: RunOptions) -> CheckResult:
    return combine_stacks("shift", [stack_result("shift", stack, lambda s=stack: _run_stack(subject, options, s))
                                    for stack in subject.stacks])


def _decided_in_float64(subject: Subject, options: RunOptions) -> CheckResult:
    """In bf16/fp16 the angle-rounding bound is larger than a whole unit shift of an absolute model, so a run
    there cannot decide (a real absolute-position leak passed under --no-upcast): the ladder runs with the
    model in float64, module by module, and is judged there. Only when no float64 run is possible does the
    half-precision run speak, saying so."""
    half = subject.dtype

    def in_float64() -> CheckResult:
        subject.dtype = torch.float64  # masks and rounding bounds of the run that decides
        try:
            return _stacks(subject, options)
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
    return replace(result, summary=f"{result.summary} (decided in {dtype_name(finer.dtype)}: a {name} run cannot "
                                   f"tell a position leak from its own rounding)",
                   details={**result.details, "decided_in": dtype_name(finer.dtype), "how": finer.how})


def _build(subject: Subject, options: RunOptions, stack: str) -> _Probe | str:
    declared = subject.max_positions  # already less the explicit offset rows (RoBERTa's padding_idx+1)
    length = probe_length(subject, options)
    if declared is not None:
        length = min(length, max(4, declared // 2))  # leave room for the ladder
    prefix = not subject.family.takes_position_ids
    recurrent = bool(recurrent_mixers(subject.language_model)) or bool(subject.family.token_mixing)
    if prefix and recurrent:
        return (f"{mixing_reason(subject)}; nor can positions be shifted by an invisible prefix (the family "
                f"takes no position_ids, and a 4D mask hides the prefix from attention only, not from these mixers)")
    if prefix:
        k_max = PREFIX_MAX_SHIFT if declared is None else min(PREFIX_MAX_SHIFT, declared - length)
    else:
        k_max = NO_CONTEXT_MAX_SHIFT if declared is None else declared - length
    k_max = min(k_max, int(options.for_check("shift").get("max_shift", k_max)))
    if k_max < 1:
        return f"the declared context ({declared}) leaves no room to shift a {length}-token probe"
    ladder = [2 ** i for i in range((k_max - 1).bit_length())] + [k_max]  # 1, 2, 4, ... below k_max, then k_max
    ids = subject.sample_ids(1, length, options.seed)[0]
    causal = stack == "decoder" and subject.kind != "encoder"
    rows: list[Row] = []
    if causal and not prefix:
        rows += fidelity_rows(ids)[0]  # rows[0]: explicit causal mask, arange positions = the base
    if prefix:
        width = length + k_max  # every row: the probe at offset k, invisible padding elsewhere
        filler = ids.roll(1).repeat(width // length + 1)[:width]

        def placed(pieces: list[tuple[int, torch.Tensor]]) -> Row:
            row_ids, valid = filler.clone(), torch.zeros(width, dtype=torch.bool, device=ids.device)
            for start, part in pieces:
                row_ids[start:start + part.numel()] = part
                valid[start:start + part.numel()] = True
            return Row(row_ids, valid=valid)

        base = len(rows)
        rows.append(placed([(0, ids)]))
        shifted = list(range(len(rows), len(rows) + len(ladder)))
        rows += [placed([(k, ids)]) for k in ladder]
        half = length // 2
        gap = len(rows)
        rows.append(placed([(0, ids[:half]), (half + 1, ids[half:])]))
        return _Probe(rows, ladder, base, shifted, gap, None, None, length, True, lambda k: placed([(k, ids)]))
    base = 0
    if not rows:
        rows.append(Row(ids))
    arange = torch.arange(length, device=ids.device)
    shifted = list(range(len(rows), len(rows) + len(ladder)))
    rows += [Row(ids, positions=arange + k) for k in ladder]  # the base row has positions=None: arange
    gap = len(rows)
    rows.append(Row(ids, positions=arange + (arange >= length // 2).long()))
    if recurrent:  # no consistent permutation through a recurrence: the jittered baseline is the floor
        rows.append(Row(ids))
        return _Probe(rows, ladder, base, shifted, gap, None, None, length, False,
                      lambda k: Row(ids, positions=arange + k), jitter=len(rows) - 1)
    gen = torch.Generator().manual_seed(options.seed + 7919)
    perm = torch.randperm(length, generator=gen).to(ids.device)
    consistent = len(rows)
    rows.append(Row(ids[perm], order=perm, positions=perm))
    return _Probe(rows, ladder, base, shifted, gap, consistent, perm, length, False,
                  lambda k: Row(ids, positions=arange + k))


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    dtype = subject.dtype_name
    absolute = subject.position_kind in ABSOLUTE_KINDS
    ok, why = subject.explicit_mask_supported
    if not ok:
        return CheckResult("shift", Status.SKIP, f"cannot hand the model an explicit mask: {why}",
                           details={"stack": stack})
    probe = _build(subject, options, stack)
    if isinstance(probe, str):
        return CheckResult("shift", Status.SKIP, probe, details={"stack": stack})
    encoder_ids = None
    if subject.kind == "seq2seq" and stack == "decoder":
        first = probe.rows[probe.base].ids
        enc = first if not probe.prefix else first[: probe.span]
        encoder_ids = enc[None].expand(len(probe.rows), -1)
    if probe.jitter is not None:
        with jittered(subject, stack, probe.jitter, len(probe.rows), options.seed) as has_jitter:
            out = run_rows(subject, probe.rows, stack=stack, encoder_ids=encoder_ids)
    else:
        has_jitter = False
        out = run_rows(subject, probe.rows, stack=stack, encoder_ids=encoder_ids)
    details: dict = {"stack": stack, "route": "prefix of invisible padding" if probe.prefix else "position_ids + k",
                     "seq_len": probe.span, "ladder": probe.ladder}
    metrics: dict = {}
    if not all(torch.isfinite(h).all() for h in out.hidden):
        return CheckResult("shift", Status.FAIL, "non-finite hidden states under shifted positions", metrics, details)

    span, half = probe.span, probe.span // 2

    def take(layer: int, row: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return out.hidden[layer][row, start:(span if stop is None else stop)]

    layers = len(out.hidden)
    final = layers - 1
    # Errors at each rung and layer; the probe sits at offset k in prefix rows.
    errors = [[relative_l2(take(l, r, k if probe.prefix else 0, (k + span) if probe.prefix else None),
                           take(l, probe.base))
               for r, k in zip(probe.shifted, probe.ladder, strict=True)] for l in range(layers)]
    gap_start = half + 1 if probe.prefix else half
    delta1 = relative_l2(take(final, probe.gap, gap_start, gap_start + span - half), take(final, probe.base, half))
    measured_floor = 0.0
    floor_source = f"{dtype} machine epsilon (positions derived inside: no consistent permutation)"
    if probe.consistent is not None:
        measured_floor = relative_l2(out.hidden[final][probe.consistent], out.hidden[final][probe.base][probe.perm])
        floor_source = "consistent permutation (tokens, mask and position ids permuted together)"
    elif probe.jitter is not None:
        if has_jitter:
            measured_floor = relative_l2(out.hidden[final][probe.jitter], out.hidden[final][probe.base])
        floor_source = f"{FLOOR_SOURCE if has_jitter else f'{dtype} machine epsilon'} ({mixing_reason(subject)})"
        if recurrent_mixers(subject.language_model):
            details["recurrent_mixers"] = recurrent_mixers(subject.language_model)
    floor = noise_floor(measured_floor, dtype)
    eps = MACHINE_EPSILON.get(dtype, MACHINE_EPSILON["float32"])
    details["floor_source"] = floor_source
    metrics.update({"noise_floor": floor, "unit_shift_effect": delta1, "eps": eps})

    # The explicit mask must reproduce the model's own output before any shifted row means anything.
    plain = Row(probe.rows[probe.base].ids[:span])
    default = run_rows(subject, [plain], stack=stack, explicit_mask=False,
                       encoder_ids=None if encoder_ids is None else encoder_ids[:1]).final[0]
    if probe.prefix:  # the base row is the probe followed by padding no query may see
        reproduces = relative_l2(take(final, probe.base), default)
        metrics["mask_reproduces_default"] = reproduces
        if reproduces > FAIL_RATIO * floor:
            return CheckResult("shift", Status.SKIP, f"padding in the explicit mask is not honoured: the padded probe "
                               f"does not reproduce the plain one (rel. error {reproduces:.2e})", metrics, details)
    elif stack == "decoder" and subject.kind != "encoder":
        fid = judge_fidelity(default, out.final[0], out.final[1], out.final[2], fidelity_rows(probe.rows[0].ids)[1],
                             measured_floor, dtype)
        metrics.update(fid.metrics())
        if not fid.ok:
            return CheckResult("shift", Status.SKIP, f"mask not faithful, no verdict: {fid.reason}", metrics, details)
    else:
        reproduces = relative_l2(out.final[probe.base], default)
        metrics["mask_reproduces_default"] = reproduces
        if reproduces > FAIL_RATIO * floor:
            return CheckResult("shift", Status.SKIP, f"explicit mask does not reproduce the default output "
                               f"(rel. error {reproduces:.2e})", metrics, details)

    predicted = [delta1 * eps * (k + span) for k in probe.ladder]  # (P_k + 1) with P_k = k + span - 1
    tolerance = [FAIL_RATIO * (floor + p) for p in predicted]
    ratio = [e / (floor + p) for e, p in zip(errors[final], predicted, strict=True)]
    breaks = next((i for i, r in enumerate(ratio) if not r <= FAIL_RATIO), None)
    table = Table(
        f"error by offset ({stack})" if subject.kind == "seq2seq" else "error by offset",
        ("k", "max position", "error", "rounding term", "tolerance", "ratio", ""),
        tuple((k, k + span - 1, f"{e:.3e}", f"{p:.2e}", f"{t:.2e}", f"{r:.3g}", "ok" if r <= FAIL_RATIO else "BREAKS")
              for k, e, p, t, r in zip(probe.ladder, errors[final], predicted, tolerance, ratio, strict=True)),
    )
    details["errors"] = errors[final]
    details["tolerances"] = tolerance
    worst_i = max(range(len(ratio)), key=lambda i: ratio[i] if ratio[i] == ratio[i] else float("inf"))
    metrics.update({"error": errors[final][worst_i], "tolerance": tolerance[worst_i], "ratio": ratio[worst_i],
                    "worst_shift": probe.ladder[worst_i], "max_shift": probe.ladder[-1]})

    signal = delta1 / floor
    metrics["unit_shift_ratio"] = signal
    if not signal >= FAIL_RATIO:
        return _no_position_effect(subject, stack, delta1, signal, probe, metrics, details, table)

    holds_up_to = None
    if breaks is not None:
        k = probe.ladder[breaks]
        layer = next((l for l in range(layers)
                      if not errors[l][breaks] <= FAIL_RATIO * (floor + predicted[breaks])), final)
        token = _worst_token(out, final, probe, breaks)
        details.update({"first_layer": layer_name(layer, layers), "worst_token": token})
        if breaks > 0 and not absolute:  # one more forward: where between the last good rung and this one
            holds_up_to, k = _refine(subject, probe, stack, encoder_ids, probe.ladder[breaks - 1], k,
                                     delta1, eps, floor)
            details["refined_between"] = [probe.ladder[breaks - 1], probe.ladder[breaks]]
        details.update({"breaks_at": k, "holds_up_to": holds_up_to})
        metrics["breaks_at"] = k

    if absolute:
        # Judged against the noise floor, not the rounding term: that term models RoPE angle rounding,
        # and in half precision it exceeds a whole unit shift of an absolute model.
        first = errors[final][0]
        if not first > FAIL_RATIO * floor:
            return CheckResult("shift", Status.SKIP,
                               f"absolute positions ({subject.position_kind}) yet a shift of {probe.ladder[0]} changes "
                               f"the outputs by only {first:.3g} ({first / floor:.3g}x the noise floor): are the "
                               f"position ids used?", metrics, details, (table,))
        return CheckResult("shift", Status.NA,
                           f"absolute positions ({subject.position_kind}): outputs change by {first:.3g} under a shift "
                           f"of {probe.ladder[0]} ({first / floor:.3g}x the noise floor), as expected; relative "
                           f"invariance does not apply", metrics, details, (table,))

    if breaks is not None and subject.family.absolute_by_design:
        details["absolute_by_design"] = subject.family.absolute_by_design
        return CheckResult("shift", Status.NA,
                           f"relative invariance does not apply: {subject.family.absolute_by_design}; a shift of "
                           f"{probe.ladder[breaks]} moves the outputs {errors[final][breaks]:.3g} "
                           f"({ratio[breaks]:.3g}x floor + rounding term); the rotation itself is judged by `rope`",
                           metrics, details, (table,))
    if breaks is not None:
        k = details["breaks_at"]
        rung = probe.ladder[breaks]
        where = (f"at shift {k} (max position {k + span - 1})" if holds_up_to is None else
                 f"between shift {holds_up_to} and {k} (max position {holds_up_to + span - 1} holds, {k + span - 1} "
                 "breaks)")
        summary = (f"relative invariance breaks {where}: at shift {rung} error {errors[final][breaks]:.3g} = "
                   f"{ratio[breaks]:.3g}x (floor {floor:.2g} + rounding term {predicted[breaks]:.2g}), first in "
                   f"{details['first_layer']}, worst at token {details['worst_token']}")
        return CheckResult("shift", Status.FAIL, summary, metrics, details, (table,))
    summary = (f"invariant under shifts up to {probe.ladder[-1]} (max position {probe.ladder[-1] + span - 1}): worst "
               f"error {errors[final][worst_i]:.3g} = {ratio[worst_i]:.3g}x (floor + rounding term) at shift "
               f"{probe.ladder[worst_i]}; a one-position change moves outputs {delta1:.3g} ({len(probe.ladder)} "
               f"shifts, {span} tokens)")
    if signal < PASS_RATIO:
        summary += f"; weak position signal ({signal:.3g}x the floor): only breaks larger than that would show"
    return CheckResult("shift", Status.PASS, summary, metrics, details, (table,))


def _no_position_effect(subject: Subject, stack: str, delta1: float, signal: float, probe: _Probe, metrics: dict,
                        details: dict, table: Table) -> CheckResult:
    """Moving half the tokens one position further changed nothing measurable. For a model that declares
    relative positions that is the bug itself (an identity rotation, position ids ignored, a zeroed
    bias): invariance holds trivially, so a PASS or a SKIP would hide it. Absolute models keep the SKIP
    (their positions are judged by `shuffle` and `table`); a half-precision run cannot tell a weak
    signal from none (WARN, naming the float32 run that would decide); outputs that cannot carry positions
    at all (tokens that never interact, equal attention scores: `posdiag.model.inert`) SKIP, saying so."""
    kind, dtype = subject.position_kind, subject.dtype_name
    moved = ("the second half of the probe one position further away" if not probe.prefix
             else "the second half of the probe one padding slot further away")
    measured = f"moving {moved} changes the outputs by only {delta1:.2e} ({signal:.3g}x the noise floor)"
    details["position_effect"] = "none measurable"
    if kind in ABSOLUTE_KINDS:
        return CheckResult("shift", Status.SKIP, f"{measured}: positions have no measurable effect, so invariance "
                           "would say nothing", metrics, details, (table,))
    if dtype in LOW_PRECISION:
        return CheckResult("shift", Status.WARN, f"inconclusive in {dtype}: {measured}, within half-precision rounding "
                           f"of the {kind} position signal; rerun in float32 (without --no-upcast) to decide whether "
                           "positions enter", metrics, details, (table,))
    if inert := inert_reason(subject, stack, probe.rows[probe.base].ids[:probe.span]):
        details["inert"] = inert
        return CheckResult("shift", Status.SKIP, f"no verdict: {inert} ({measured})", metrics, details, (table,))
    return CheckResult("shift", Status.FAIL,
                       f"positions move nothing: the model declares {kind} positions, yet {measured}; relative "
                       "offsets never reach attention (an identity rotation, position ids ignored, a zeroed bias), so "
                       "shift invariance would hold trivially", metrics, details, (table,))


def _refine(subject: Subject, probe: _Probe, stack: str, encoder_ids, lo: int, hi: int, delta1: float, eps: float,
            floor: float) -> tuple[int, int]:
    """Up to 16 shifts strictly between lo (held) and hi (broke), in one forward: (last held, first broken)."""
    step = max(1, (hi - lo) // 17)
    ks = list(range(lo + step, hi, step))[:16]
    if not ks:
        return lo, hi
    rows = [probe.make_row(0)] + [probe.make_row(k) for k in ks]
    enc = None if encoder_ids is None else encoder_ids[:1].expand(len(rows), -1)
    final = run_rows(subject, rows, stack=stack, encoder_ids=enc).final
    span = probe.span
    held = lo
    for i, k in enumerate(ks, start=1):
        start = k if probe.prefix else 0
        error = relative_l2(final[i, start:start + span], final[0, :span])
        if not error <= FAIL_RATIO * (floor + delta1 * eps * (k + span)):
            return held, k
        held = k
    return held, hi


def _worst_token(out, layer: int, probe: _Probe, rung: int) -> int:
    k = probe.ladder[rung]
    start = k if probe.prefix else 0
    a = out.hidden[layer][probe.shifted[rung], start:start + probe.span].double()
    b = out.hidden[layer][probe.base, :probe.span].double()
    return int((a - b).norm(dim=-1).argmax())


