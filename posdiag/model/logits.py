"""Scoring targets without holding full-vocabulary logits: each chunk of rows is reduced as it comes out.

A probe that needs the log-probability of a target token (or whether the argmax hits it) at many positions
would hold [rows, T, vocab] logits if it ran every row at once: 16 rows x 1024 tokens x 49k vocabulary is
3.2 GB in float32. Here the model runs on as many rows as fit in `budget` bytes of logits (one row at the
least), and each chunk is reduced to two small tensors, log p(target) and argmax == target, before the next
chunk runs. The logits come from the model's own forward, so whatever its head class does after the LM head
(Gemma's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling) is included: applying the LM
head by hand to the final hidden state would have to re-implement each of those. The price is that one row's
[T, vocab] logits exist at a time, which the callers bound by their row length.

Within a chunk the log-softmax is taken in slices of positions, so its temporaries stay a fraction of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGIT_BUDGET = 256 << 20  # bytes of float32 logits one forward may produce (one row at the least)
POSITION_SLICE = 256  # positions per log-softmax slice inside a chunk


@dataclass(frozen=True)
class TargetScores:
    """logprob: [B, T] float64 log p(target) at each position (NaN where no target);
    hit: [B, T] bool, argmax == target (False where no target)."""

    logprob: torch.Tensor
    hit: torch.Tensor


def rows_per_chunk(length: int, vocab: int, budget: int = LOGIT_BUDGET) -> int:
    """How many rows of `length` tokens keep one forward's float32 logits within `budget` bytes."""
    return max(1, budget // max(1, length * vocab * 4))


def reduce_logits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, V] logits, [B, T] targets (-1: none) -> (log p(target) float64 [B, T], argmax hit [B, T]).

    Computed in float32 or finer, slice by slice of positions; non-finite logits give NaN log-probs. Raises
    ValueError when the logits are not one distribution per token (several heads, codebooks)."""
    rows, length = targets.shape
    if logits.ndim != 3 or tuple(logits.shape[:2]) != (rows, length):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {rows} x {length} tokens (one vocabulary "
                         "distribution per token expected)")
    if int(targets.max()) >= logits.shape[-1]:
        raise ValueError(f"targets beyond the {logits.shape[-1]} logits per token")
    logprob = torch.full((rows, length), float("nan"), dtype=torch.float64)
    hit = torch.zeros((rows, length), dtype=torch.bool)
    for start in range(0, length, POSITION_SLICE):
        sl = slice(start, min(length, start + POSITION_SLICE))
        chunk = logits[:, sl]
        if chunk.dtype not in (torch.float32, torch.float64):
            chunk = chunk.float()
        want = targets[:, sl].to(chunk.device)
        scored = want >= 0
        picked = chunk.gather(-1, want.clamp(min=0)[..., None])[..., 0]
        value = (picked - torch.logsumexp(chunk, dim=-1)).double().cpu()
        logprob[:, sl] = torch.where(scored.cpu(), value, logprob[:, sl])
        hit[:, sl] = (chunk.argmax(-1) == want).cpu() & scored.cpu()
    return logprob, hit


def score_targets(subject, ids: torch.Tensor, targets: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                  budget: int = LOGIT_BUDGET) -> TargetScores:
    """Run `subject` on ids [B, T] (equal-length rows, no padding: the model's own causal pattern) in chunks of
    rows sized by `budget`, reducing each chunk's logits to the target scores before the next one runs.
    position_ids [B, T]: passed as given (None: the model's defaults). Raises when the model returns no logits.
    Positions before the first target are left out of the LM head where the model takes logits_to_keep (the
    second copy of a repeated sequence needs half the head a whole row would)."""
    rows, length = targets.shape
    first = _first_target(subject, targets)
    step = rows_per_chunk(length - first, subject.vocab_size, budget)
    if subject.options.max_batch:
        step = min(step, subject.options.max_batch)
    logprob = torch.full((rows, length), float("nan"), dtype=torch.float64)
    hit = torch.zeros((rows, length), dtype=torch.bool)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        logits = _logits(subject, ids[sl], None if position_ids is None else position_ids[sl], length - first)
        kept = length - logits.shape[1]
        logprob[sl, kept:], hit[sl, kept:] = reduce_logits(logits, targets[sl, kept:])
        del logits
    return TargetScores(logprob, hit)


def _first_target(subject, targets: torch.Tensor) -> int:
    """The first position whose logits any row needs; 0 where the model takes no logits_to_keep."""
    if not subject.is_hf or not subject.takes_logits_to_keep:
        return 0
    wanted = (targets >= 0).any(dim=0).nonzero()
    return int(wanted[0, 0]) if wanted.numel() else 0


def _logits(subject, ids: torch.Tensor, position_ids: torch.Tensor | None, keep: int) -> torch.Tensor:
    """The model's logits for one chunk: a plain call (no hidden states kept, no cache) on a transformers model,
    for the last `keep` positions where that is fewer than all (the full logits where the model answers that in
    another shape), the factory protocol otherwise."""
    ids = ids.to(subject.device)
    if not subject.is_hf:
        out = subject.forward(ids, position_ids=position_ids, want_logits=True)
        if out.logits is None:
            raise ValueError("the model returns no logits")
        return out.logits
    kwargs = {} if position_ids is None else {"position_ids": position_ids.to(subject.device)}
    if keep < ids.shape[1]:
        logits = _called(subject, ids, logits_to_keep=keep, **kwargs)
        if logits.ndim == 3 and tuple(logits.shape[:2]) == (ids.shape[0], keep):
            return logits
    return _called(subject, ids, **kwargs)


def _called(subject, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    subject.forward_count += 1
    with torch.inference_mode():
        out = subject.model(input_ids=ids, use_cache=False, return_dict=True, **kwargs)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise ValueError("the model returns no logits")
    return logits
