"""Rows of probe inputs, run in one batched forward, and the mask-fidelity probe.

A `Row` says which tokens, in which logical order (for the attention pattern), at which
position ids, with which padding. `run_rows` stacks any number of rows into one forward
call (split only by --max-batch), so a check pays for one pass, not one per variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.errors import MaskRefused, describe_error, raised_in_posdiag
from posdiag.model.subject import Outputs, Subject
from posdiag.model.tensors import relative_l2
from posdiag.verdict import FAIL_RATIO, MACHINE_EPSILON, agreement_tolerance


@dataclass
class Row:
    """One sequence of a batched probe.

    ids:       token ids [T].
    order:     logical index of each token [T]; the causal pattern is order[k] <= order[q].
    positions: position ids to pass [T]; None = arange (passed only where the family takes them).
    valid:     bool [T], False at padding; None = all valid.
    edit:      optional bool[B,T,T] -> bool[B,T,T] applied to this row's attention pattern.
    """

    ids: torch.Tensor
    order: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    edit: Callable[[torch.Tensor], torch.Tensor] | None = None


def moving_permutations(length: int, count: int, seed: int) -> list[torch.Tensor]:
    """Random permutations that move every token where possible (a fixed point tests nothing there)."""
    gen = torch.Generator().manual_seed(seed)
    perms = []
    for _ in range(count):
        perm = torch.randperm(length, generator=gen)
        for _ in range(20):
            if not bool((perm == torch.arange(length)).any()):
                break
            perm = torch.randperm(length, generator=gen)
        perms.append(perm)
    return perms


def arange_like(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[-1], device=ids.device)


def run_rows(subject: Subject, rows: list[Row], *, stack: str = "decoder", explicit_mask: bool = True,
             encoder_ids: torch.Tensor | None = None, want_logits: bool = False) -> Outputs:
    """Run every row in one forward (per --max-batch chunk).

    explicit_mask=True hands the model the rows' patterns in the family's form (the only way
    to attend by a permuted order, and the only safe way with non-consecutive position ids:
    without a mask transformers reads such ids as packed sequences and builds a block-diagonal
    mask). explicit_mask=False lets the model build its own default mask. Logits only when
    asked (want_logits): most checks compare hidden states, and the LM head is the largest output.

    A model that refuses the explicit form (Flaubert and FSMT assert a 2D mask, DeBERTa multiplies
    its embeddings by the mask: measured by `mask_refusal`) gets the patterns as a 2D padding mask
    where that form says the same (every pattern in its default order, padding keys hidden: a plain
    or shuffled bidirectional stack, an unpermuted causal one); an explicit tensor, so transformers
    never reads the ids as packed sequences. Any other pattern raises MaskRefused (a SKIP, with why).
    """
    ids = torch.stack([r.ids for r in rows]).to(subject.device)
    position_ids = None
    if subject.family.takes_position_ids:
        logical = torch.stack([r.positions if r.positions is not None else arange_like(r.ids) for r in rows])
        position_ids = subject.position_ids_for(logical.to(subject.device))

    def call(mask: Any, patterns: dict[str, torch.Tensor] | None) -> Outputs:
        with subject.injected(patterns):
            return subject.forward(ids, mask=mask, position_ids=position_ids, stack=stack, encoder_ids=encoder_ids,
                                   want_logits=want_logits)

    if not explicit_mask:
        return call(None, None)
    per_row = [
        subject.patterns(
            (r.order if r.order is not None else arange_like(r.ids))[None],
            None if r.valid is None else r.valid[None],
            stack=stack,
            edit=r.edit,
        )
        for r in rows
    ]
    patterns = {k: torch.cat([p[k] for p in per_row]) for k in per_row[0]}
    mask = subject.mask_argument(patterns)
    if mask is None:
        return call(None, patterns)
    if stack not in subject.mask_refusals:
        try:
            out = call(mask, patterns)
        except Exception as exc:
            if raised_in_posdiag(exc) or not mask_refusal(subject, stack):
                raise
        else:
            subject.mask_refusals[stack] = ""  # the explicit form ran: nothing refused
            return out
    if not subject.mask_refusals[stack]:
        return call(mask, patterns)
    padding = padding_mask(subject, rows, patterns, stack)
    if padding is None:
        raise MaskRefused(f"{subject.mask_refusals[stack]}; this probe's pattern (permuted or edited) has no 2D "
                          "padding-mask form")
    return call(padding, None)


def padding_mask(subject: Subject, rows: list[Row], patterns: dict[str, torch.Tensor],
                 stack: str) -> torch.Tensor | None:
    """The 2D padding mask [B, T] (1 = token, 0 = padding) whose default pattern is `patterns` at every
    valid query, or None when no 2D mask says the same (a permuted causal order, an edited pattern).
    Padded queries are left out: their outputs are excluded from every comparison."""
    valid = torch.stack([torch.ones_like(r.ids, dtype=torch.bool) if r.valid is None else r.valid.bool()
                         for r in rows]).to(subject.device)
    order = torch.arange(valid.shape[-1], device=subject.device).expand_as(valid)
    implied = subject.patterns(order, valid, stack=stack)
    for key, pattern in patterns.items():
        if key not in implied or not bool((implied[key] == pattern)[valid].all()):
            return None
    return valid.long()


def mask_refusal(subject: Subject, stack: str) -> str:
    """Why this stack refuses an explicit attention pattern in the family's form ("" when it takes one).

    Measured once per stack, on two rows of 8 tokens, and remembered: the explicit all-visible pattern must raise in
    the model's own code where the plain call runs (a model that cannot run at all is not refusing a
    mask: "", and its error surfaces where it happens). A capability probe, not a pass of any check: its
    forwards are not counted. Call it before hooking a module that counts calls (the jitter floor)."""
    if stack in subject.mask_refusals:
        return subject.mask_refusals[stack]
    if subject.mask_argument(subject.patterns(torch.zeros(1, 1, dtype=torch.long), stack=stack)) is None:
        return ""  # patterns travel by injection: there is no explicit form to refuse
    # Two rows: LayoutLM unsqueezes whatever mask it gets into [B, 1, 1, ...]; one row of a 4D mask broadcasts
    # through and runs (wrongly), two rows raise (a shape error in the attention output), as the probes' batches do.
    ids = subject.sample_ids(2, 8, 0)
    encoder = ids if subject.kind == "seq2seq" and stack == "decoder" else None
    order = arange_like(ids).expand_as(ids)
    patterns = subject.patterns(order, stack=stack)
    # As run_rows calls it: OPT derives positions from a 2D mask and needs explicit ids beside a 4D one.
    positions = subject.position_ids_for(order) if subject.family.takes_position_ids else None
    counted = subject.forward_count
    why = ""
    try:
        with subject.injected(patterns):
            subject.forward(ids, mask=subject.mask_argument(patterns), position_ids=positions, stack=stack,
                            encoder_ids=encoder)
    except Exception as exc:
        if raised_in_posdiag(exc):
            raise
        try:
            subject.forward(ids, stack=stack, encoder_ids=encoder)
        except Exception as plain:
            if raised_in_posdiag(plain):
                raise
            subject.forward_count = counted
            return ""
        module = subject.model.get_encoder() if subject.kind == "seq2seq" and stack == "encoder" else subject.model
        why = f"{type(module).__name__} refuses an explicit 4D attention mask: {_where(exc)}"
    subject.forward_count = counted
    subject.mask_refusals[stack] = why
    return why


def _where(exc: BaseException) -> str:
    """`Type: message`, and where the model raised it when the message is empty (a bare assert)."""
    import traceback
    from pathlib import Path

    text = describe_error(exc)
    if str(exc).strip():
        return text
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{text.rstrip(': ')} in {frame.name} ({Path(frame.filename).name}:{frame.lineno})"


# ------------------------------------------------------------------------ mask fidelity
@dataclass(frozen=True)
class Fidelity:
    """Is an explicit attention pattern honoured? Measured, never assumed from a signature.

    reproduces: explicit causal mask vs the model's own default (relative L2).
    block_effect: change at later queries when one past key is blocked.
    open_effect: change at one query when a future key is opened (a hard-coded causal buffer
    ANDed into the scores shows as no effect).
    """

    ok: bool
    reason: str
    reproduces: float
    block_effect: float
    open_effect: float
    tolerance: float

    def metrics(self) -> dict[str, float]:
        return {"mask_reproduces_default": self.reproduces, "mask_block_effect": self.block_effect,
                "mask_open_effect": self.open_effect, "mask_tolerance": self.tolerance}


def fidelity_rows(ids: torch.Tensor) -> tuple[list[Row], tuple[int, int, int]]:
    """Rows: explicit causal; keys [T/4, T/2] blocked for every later query; the first T/4
    queries allowed to see every key (future ones included). Edits are wide on purpose: a
    single key can carry almost no attention weight in a random model. The block ends one past
    T/2 so that it reaches into the chunk of the first query after it: with chunks dividing T/2,
    a block ending at T/2 hid only keys of earlier chunks, which chunked layers never see
    (measured on a Llama 4 whose layers all attend by chunks of 8: "the mask is ignored")."""
    t = ids.shape[-1]
    block_from, block_to, open_upto = t // 4, min(t - 1, t // 2 + 1), max(1, t // 4)

    def block(a: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a[:, block_to:, block_from:block_to] = False
        return a

    def open_(a: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a[:, :open_upto, :] = True
        return a

    return [Row(ids), Row(ids, edit=block), Row(ids, edit=open_)], (block_to, open_upto, block_from)


def judge_fidelity(default: torch.Tensor, explicit: torch.Tensor, blocked: torch.Tensor, opened: torch.Tensor,
                   where: tuple[int, int, int], measured_floor: float, dtype: str) -> Fidelity:
    """Each input is a final hidden state [T, D] of the matching fidelity row.

    Reproduction is judged against the dtype's floor (two computations that must agree).
    Block/open effects are judged against what an *ignored* edit gives: the same row
    recomputed in the same batch, bitwise identical in practice (0.0 measured in every
    family, bf16 included). So the threshold is a few float32 epsilons whatever the dtype,
    and does not lean on the consistent-permutation floor (itself meaningless when the mask
    is not honoured).
    """
    changed_from, opened_upto, _ = where
    reproduces = relative_l2(explicit, default)
    block_effect = relative_l2(blocked[changed_from:], explicit[changed_from:])
    open_effect = relative_l2(opened[:opened_upto], explicit[:opened_upto])
    tolerance = agreement_tolerance(measured_floor, dtype)
    effect_needed = FAIL_RATIO * MACHINE_EPSILON["float32"]
    if reproduces > tolerance:
        reason = (f"explicit causal mask does not reproduce the model's default output "
                  f"(rel. error {reproduces:.2e} > {tolerance:.1e})")
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    if block_effect < effect_needed:
        reason = f"blocking keys in the explicit mask changes nothing (effect {block_effect:.1e}): the mask is ignored"
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    if open_effect < effect_needed:
        reason = f"opening future keys changes nothing (effect {open_effect:.1e}): a causal pattern is hard-coded"
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    return Fidelity(True, "explicit mask honoured", reproduces, block_effect, open_effect, tolerance)




def logits_at(subject: Subject, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cache-free logits of each row of `ids` ([R, T]) at its own positions (`positions`, [R, P] integer), as
    [R, P, vocab] in float32. The LM head runs at those positions only where the model takes a 2D logits_to_keep
    (transformers' slice_logits_to_keep); elsewhere (or where that answers in another shape) the full logits of a few
    rows at a time are gathered as they come out. Each call's logits stay within a tenth of the weights' memory in
    float64 (the arbitration's re-run): no [T, vocab] output is kept for more than one chunk of rows."""
    budget = sum(p.numel() for p in subject.model.parameters()) * 8 // 10
    keep = subject.takes_logits_to_keep
    width = positions.shape[1] if keep else ids.shape[1]
    rows = max(1, budget // (width * (subject.vocab_size or 1) * 8))
    parts = []
    for start in range(0, ids.shape[0], rows):
        chunk, where = ids[start:start + rows], positions[start:start + rows].to(ids.device)
        got = _logits(subject, chunk, where) if keep else None
        if got is None:
            full = _logits(subject, chunk, None)
            got = full.gather(1, where[..., None].expand(-1, -1, full.shape[-1]))
        parts.append(got.float())
    return torch.cat(parts)


def _logits(subject: Subject, ids: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor | None:
    """One cache-free forward's logits, at `where` ([R, P]) through logits_to_keep, or at every position (None).
    None where the model does not answer logits_to_keep with logits of that shape."""
    kwargs: dict[str, Any] = {} if where is None else {"logits_to_keep": where}
    subject.forward_count += 1
    try:
        with torch.inference_mode():
            out = subject.model(input_ids=ids, use_cache=False, return_dict=True, **kwargs)
        logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    except Exception:
        if where is None:
            raise
        subject.forward_count -= 1  # not answered: the full logits are taken instead
        return None
    if where is not None and tuple(logits.shape[:2]) != tuple(where.shape):
        return None
    return logits


def position_limit(subject: Subject) -> int | None:
    """Largest logical position id the probes may use (the declared context, less table offsets)."""
    declared = subject.max_positions
    if declared is None:
        return None
    return declared - 1 - max(0, subject.family.position_offset - subject.family.explicit_position_offset)


def restart_positions(length: int) -> torch.Tensor:
    """Two packed documents: 0..h-1, 0..T-h-1 (the pattern stays one causal/bidirectional block)."""
    half = length // 2
    return torch.cat([torch.arange(half), torch.arange(length - half)])
