"""The shift ladder: the rows of one stack (plan), its one forward and the errors read from it (measure).

Two routes. Direct: the probe with position_ids + k for each rung k, the same row with its second half one
position further away (Δ1), and a floor row (the consistent permutation, or the jittered baseline behind a
recurrent mixer). Prefix: for families that take no position_ids, every row carries k invisible padding tokens
before the probe, so the probe sits at offset k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posdiag.model.introspect import mixing_reason, recurrent_mixers
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.probe import Row, fidelity_rows, run_rows
from posdiag.model.subject import Outputs, Subject
from posdiag.model.tensors import relative_l2
from posdiag.options import RunOptions, probe_length
from posdiag.verdict import within_tolerance

NO_CONTEXT_MAX_SHIFT = 4096  # direct route, when the config declares no context
PREFIX_MAX_SHIFT = 256  # prefix route: every row carries the longest prefix, so keep it bounded


@dataclass(frozen=True)
class Plan:
    """How far one stack can be shifted, and by which route."""

    length: int  # tokens of the probe
    ladder: list[int]  # the rungs k: 1, 2, 4, ... below the largest, then the largest
    prefix: bool  # shifted by invisible padding tokens instead of position ids
    recurrent: bool  # order also enters through recurrent or non-attention token mixers


@dataclass
class Probe:
    """The rows of one stack and where each comparison reads them."""

    rows: list[Row]
    ladder: list[int]
    base: int  # row of the unshifted probe
    shifted: list[int]  # row of each rung
    gap: int  # row with the second half one position further away
    span: int  # tokens of the probe
    prefix: bool  # shifted by invisible padding tokens instead of position ids
    make_row: Callable[[int], Row]  # the probe shifted by k
    consistent: int | None = None  # row of the consistent permutation (floor), direct route only
    perm: torch.Tensor | None = None  # the permutation of that row
    jitter: int | None = None  # row of the jittered baseline (floor), recurrent mixers only
    half: int = 0  # where the gap row's second part starts (0: span // 2)


@dataclass
class Measured:
    """What the ladder's forward measured, final layer unless said."""

    out: Outputs
    errors: list[list[float]]  # [layer][rung]: relative change of the probe under each shift
    delta1: float  # change when half the tokens move one position further away
    measured_floor: float  # the floor row's change (0.0 where none was measured)
    floor_source: str
    recurrent_mixers: list[str]
    encoder_ids: torch.Tensor | None  # the fixed encoder input of a seq2seq decoder, one per row


def plan(subject: Subject, options: RunOptions, max_shift: int | None) -> Plan | str:
    """The probe length and the ladder, or why this stack cannot be shifted (a SKIP reason)."""
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
    if max_shift is not None:
        k_max = min(k_max, int(max_shift))
    if k_max < 1:
        return f"the declared context ({declared}) leaves no room to shift a {length}-token probe"
    ladder = [2 ** i for i in range((k_max - 1).bit_length())] + [k_max]  # 1, 2, 4, ... below k_max, then k_max
    return Plan(length=length, ladder=ladder, prefix=prefix, recurrent=recurrent)


def build(subject: Subject, options: RunOptions, stack: str, planned: Plan) -> Probe:
    """The rows of the planned route, for one sampled probe."""
    ids = subject.sample_ids(1, planned.length, options.seed)[0]
    if planned.prefix:
        return _prefix_probe(ids, planned.ladder)
    causal = stack == "decoder" and subject.kind != "encoder"
    return _direct_probe(ids, planned.ladder, causal, planned.recurrent, options.seed, subject.attention_chunk)


def _prefix_probe(ids: torch.Tensor, ladder: list[int]) -> Probe:
    """Every row: the probe at offset k, invisible padding elsewhere."""
    length = ids.numel()
    width = length + ladder[-1]
    filler = ids.roll(1).repeat(width // length + 1)[:width]

    def placed(pieces: list[tuple[int, torch.Tensor]]) -> Row:
        row_ids, valid = filler.clone(), torch.zeros(width, dtype=torch.bool, device=ids.device)
        for start, part in pieces:
            row_ids[start:start + part.numel()] = part
            valid[start:start + part.numel()] = True
        return Row(row_ids, valid=valid)

    half = length // 2
    rows = [placed([(0, ids)])]
    rows += [placed([(k, ids)]) for k in ladder]
    rows.append(placed([(0, ids[:half]), (half + 1, ids[half:])]))
    return Probe(rows=rows, ladder=ladder, base=0, shifted=list(range(1, 1 + len(ladder))), gap=len(rows) - 1,
                 span=length, prefix=True, make_row=lambda k: placed([(k, ids)]))


def _direct_probe(ids: torch.Tensor, ladder: list[int], causal: bool, recurrent: bool, seed: int,
                  chunk: int | None = None) -> Probe:
    """position_ids + k per rung; the floor row last. The gap row's gap sits inside an attention chunk: chunked
    layers attend within chunks, so a gap on a chunk boundary changes no offset any query sees (measured on the tiny
    Llama 4, chunk 8, 64 tokens: Δ1 8.8e-08, 0.7x the floor, read as "positions move nothing")."""
    length = ids.numel()
    half = length // 2
    if chunk and half % chunk == 0:
        half += max(1, chunk // 2) if half + chunk // 2 < length else -max(1, chunk // 2)
    rows = list(fidelity_rows(ids)[0]) if causal else [Row(ids)]  # rows[0]: the base (arange positions)
    arange = torch.arange(length, device=ids.device)
    shifted = list(range(len(rows), len(rows) + len(ladder)))
    rows += [Row(ids, positions=arange + k) for k in ladder]  # the base row has positions=None: arange
    gap = len(rows)
    rows.append(Row(ids, positions=arange + (arange >= half).long()))
    floor_row = len(rows)
    if recurrent:  # no consistent permutation through a recurrence: the jittered baseline is the floor
        rows.append(Row(ids))
        floor = {"jitter": floor_row}
    else:
        gen = torch.Generator().manual_seed(seed + 7919)
        perm = torch.randperm(length, generator=gen).to(ids.device)
        rows.append(Row(ids[perm], order=perm, positions=perm))
        floor = {"consistent": floor_row, "perm": perm}
    return Probe(rows=rows, ladder=ladder, base=0, shifted=shifted, gap=gap, span=length, prefix=False,
                 make_row=lambda k: Row(ids, positions=arange + k), half=half, **floor)


def measure(subject: Subject, probe: Probe, stack: str, seed: int) -> Measured | None:
    """The ladder's one forward, read at every rung and layer; None on non-finite hidden states."""
    encoder_ids = None
    if subject.kind == "seq2seq" and stack == "decoder":
        first = probe.rows[probe.base].ids
        enc = first if not probe.prefix else first[: probe.span]
        encoder_ids = enc[None].expand(len(probe.rows), -1)
    has_jitter = False
    if probe.jitter is not None:
        with jittered(subject, stack, probe.jitter, len(probe.rows), seed) as has_jitter:
            out = run_rows(subject, probe.rows, stack=stack, encoder_ids=encoder_ids)
    else:
        out = run_rows(subject, probe.rows, stack=stack, encoder_ids=encoder_ids)
    if not all(torch.isfinite(h).all() for h in out.hidden):
        return None
    floor, source, recurrent = _floor(subject, probe, out, has_jitter)
    return Measured(out=out, errors=_errors(probe, out), delta1=_unit_shift(probe, out), measured_floor=floor,
                    floor_source=source, recurrent_mixers=recurrent, encoder_ids=encoder_ids)


def _take(probe: Probe, out: Outputs, layer: int, row: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    return out.hidden[layer][row, start:(probe.span if stop is None else stop)]


def _errors(probe: Probe, out: Outputs) -> list[list[float]]:
    """Errors at each layer and rung; the probe sits at offset k in prefix rows."""
    span = probe.span
    return [[relative_l2(_take(probe, out, l, r, k if probe.prefix else 0, (k + span) if probe.prefix else None),
                         _take(probe, out, l, probe.base))
             for r, k in zip(probe.shifted, probe.ladder, strict=True)] for l in range(len(out.hidden))]


def _unit_shift(probe: Probe, out: Outputs) -> float:
    """Δ1: the output change when the second half of the probe moves one position further away."""
    final, half = len(out.hidden) - 1, probe.half or probe.span // 2
    gap_start = half + 1 if probe.prefix else half
    return relative_l2(_take(probe, out, final, probe.gap, gap_start, gap_start + probe.span - half),
                       _take(probe, out, final, probe.base, half))


def _floor(subject: Subject, probe: Probe, out: Outputs, has_jitter: bool) -> tuple[float, str, list[str]]:
    """(measured floor, where it comes from, the recurrent mixers that made it a jittered one)."""
    final, dtype = out.hidden[-1], subject.dtype_name
    if probe.consistent is not None:
        return (relative_l2(final[probe.consistent], final[probe.base][probe.perm]),
                "consistent permutation (tokens, mask and position ids permuted together)", [])
    if probe.jitter is None:
        return 0.0, f"{dtype} machine epsilon (positions derived inside: no consistent permutation)", []
    measured = relative_l2(final[probe.jitter], final[probe.base]) if has_jitter else 0.0
    source = f"{FLOOR_SOURCE if has_jitter else f'{dtype} machine epsilon'} ({mixing_reason(subject)})"
    return measured, source, recurrent_mixers(subject.language_model)


def default_output(subject: Subject, probe: Probe, stack: str, encoder_ids: torch.Tensor | None) -> torch.Tensor:
    """The probe alone through the model's own mask: what the explicit mask must reproduce."""
    plain = Row(probe.rows[probe.base].ids[:probe.span])
    return run_rows(subject, [plain], stack=stack, explicit_mask=False,
                    encoder_ids=None if encoder_ids is None else encoder_ids[:1]).final[0]


def refine(subject: Subject, probe: Probe, stack: str, encoder_ids, lo: int, hi: int, delta1: float, eps: float,
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
        if not within_tolerance(error, floor + delta1 * eps * (k + span)):
            return held, k
        held = k
    return held, hi


def worst_token(out: Outputs, layer: int, probe: Probe, rung: int) -> int:
    """The token whose output moves most at this rung."""
    k = probe.ladder[rung]
    start = k if probe.prefix else 0
    a = out.hidden[layer][probe.shifted[rung], start:start + probe.span].double()
    b = out.hidden[layer][probe.base, :probe.span].double()
    return int((a - b).norm(dim=-1).argmax())
