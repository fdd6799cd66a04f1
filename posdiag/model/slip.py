"""posdiag's own one-position slip: every forward that continues a cache numbered one position early.

The power of an agreement path (could its PASS have failed?) is the error of the same path with the smallest position
bug planted at its boundary (verdict.with_power). Continuing a cache is every serving path's boundary: the second
chunk of a chunked prefill, the suffix after a shared prefix, a decode step, a verification of drafts. While
`one_early` holds, a forward of the model on a non-empty cache runs with position_ids one below those it would have
used (those passed, else the cache length on: transformers' default numbering), which is the real bug of a forward
that numbers a continuation from cache length - 1. A forward on an empty cache (a prefill, the full forward every
path is compared with) is left alone.

Where the model numbers a continuation itself from something posdiag cannot see (no position_ids passed to a
left-padded batch: a model may count its mask, OPT does), posdiag does not guess: that forward runs unslipped and is
counted as such.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from posdiag.model.subject import Subject


@dataclass
class Slipped:
    """What the slip reached while it held: forwards numbered one early, and continued forwards it left alone."""

    forwards: int = 0
    left: int = 0


def _cache_length(kwargs: dict) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if callable(get) else 0


@contextlib.contextmanager
def one_early(subject: Subject) -> Iterator[Slipped]:
    """The slip planted on the model's top module (after any hook already there: a plant's numbering is the path's
    own, slipped like the rest) for the block; it counts what it reached."""
    reached = Slipped()

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        past = _cache_length(kwargs)
        if past <= 0:
            return None
        given = kwargs.get("position_ids")
        if given is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            padded = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())
            if not isinstance(ids, torch.Tensor) or padded:
                reached.left += 1
                return None
            steps = torch.arange(past, past + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
            given = subject.position_ids_for(steps)
        kwargs["position_ids"] = given - 1
        reached.forwards += 1
        return args, kwargs

    handle = subject.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield reached
    finally:
        handle.remove()
