"""The same-forward noise floor: one row repeated with its token embeddings jittered by ~1 ulp.

A comparison that must agree "within rounding" needs the rounding measured in the same run; jittering one row's
token embeddings by about one unit of the dtype and running it beside the others gives exactly that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from posdiag.model.probe import mask_refusal
from posdiag.model.subject import Subject

FLOOR_SOURCE = "token embeddings of one row jittered by ~1 ulp, same forward (rounding sensitivity)"


def embedding_module(subject: Subject, stack: str) -> torch.nn.Module | None:
    """The token-embedding module that feeds `stack` (None when none can be found)."""
    model = subject.model
    with contextlib.suppress(Exception):
        if subject.kind == "seq2seq":
            part = model.get_encoder() if stack == "encoder" else model.get_decoder()
            return part.get_input_embeddings()
        if hasattr(model, "get_input_embeddings"):
            emb = model.get_input_embeddings()
            if emb is not None:
                return emb
    return next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


@contextlib.contextmanager
def jittered(subject: Subject, stack: str, row: int, total_rows: int, seed: int = 0,
             settle_masks: bool = True) -> Iterator[bool]:
    """Within the block, the token embeddings of batch row `row` are multiplied by (1 + ε·n).

    Works across --max-batch chunks: forward() splits rows in order into chunks of
    `max_batch`, and the hooked module is called once per chunk (twice when an encoder-decoder
    shares one embedding between its stacks and the decoder stack is run — then both calls of
    that row are jittered, still rounding-level noise). Yields False when no embedding module
    was found (the caller falls back to the machine epsilon and says so). `settle_masks=False` for a caller that
    calls the model itself, without the explicit masks whose refusal is settled first.
    """
    emb = embedding_module(subject, stack)
    if emb is None:
        yield False
        return
    if settle_masks:
        mask_refusal(subject, stack)  # settled now: finding out later, under the hook, would add calls it counts
    step = subject.options.max_batch or total_rows
    target_chunk, local = divmod(row, step)
    calls_per_chunk = 1
    if subject.kind == "seq2seq" and stack == "decoder":
        with contextlib.suppress(Exception):
            if subject.model.get_encoder().get_input_embeddings() is emb:
                calls_per_chunk = 2
    state = {"calls": 0}

    def hook(module, args, out):
        chunk = state["calls"] // calls_per_chunk
        state["calls"] += 1
        if chunk != target_chunk or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        gen = torch.Generator().manual_seed(seed + 104729)
        noise = torch.randn(out[local].shape, generator=gen).to(out.device, out.dtype)
        out = out.clone()
        out[local] = out[local] * (1 + torch.finfo(out.dtype).eps * noise)
        return out

    handle = emb.register_forward_hook(hook)
    try:
        yield True
    finally:
        handle.remove()
