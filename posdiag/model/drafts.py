"""Assisted decoding that rolls back: a draft that disagrees with the model, and the rejected drafts counted.

The model as its own assistant drafts exactly what it would choose: greedy verification accepts every draft, the
cache is never cropped, and a bug only a rollback reaches (a crop that keeps a stale position, positions not rewound
after a rejection: vLLM #54498, transformers #30068) never runs. The draft here is the same model, its modules shared
(no second copy of the weights), whose proposal for every odd position is its runner-up token: greedy verification
rejects exactly those, so a step that drafts two tokens keeps one and crops the other, and generate()'s output is
still greedy's. The rollbacks are counted on the model's own calls, from its cache: a call that finds the cache
shorter than the previous call left it continues after a crop.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# An nn.Module's hook tables: a shallow copy shares them, so the draft gets copies of its own (the rollback counter
# registered on the model afterwards must not count the draft's calls, nor the draft's hook run on the model's).
HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs")


@dataclass
class Rollbacks:
    """What a generate() call's verifications did: the model's cached calls, and the drafts cropped off its cache."""

    calls: int = 0
    crops: int = 0
    rejected: int = 0

    def __str__(self) -> str:
        return (f"{self.rejected} drafted token{'s' if self.rejected != 1 else ''} rejected and rolled back in "
                f"{self.crops} of {self.calls} verification{'s' if self.calls != 1 else ''}")


def _cache_in(kwargs: dict) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _length(cache: Any) -> int | None:
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if callable(get) else None


@contextlib.contextmanager
def drafts_set(model: Any, candidates: int) -> Iterator[None]:
    """The model's generation config set to draft `candidates` tokens every step (transformers' default schedule grows
    the drafts until one step drafts every token; its confidence criterion stops a draft whose probability is under
    0.4, which a small or untrained model's always is), put back after."""
    config = model.generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = tuple(getattr(config, n, None) for n in names)
    for name, value in zip(names, (candidates, "constant", 0.0), strict=True):
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(config, name, value)


def runner_up(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """The draft's forward hook: where the next position is odd, the last position's best logit is pushed below the
    others, so the draft proposes its runner-up (a token the model rejects)."""
    logits = getattr(output, "logits", None)
    length = _length(_cache_in(kwargs))
    if not isinstance(logits, torch.Tensor) or length is None or length % 2 == 0:
        return output
    logits = logits.clone()
    last = logits[:, -1]
    rows = torch.arange(last.shape[0], device=last.device)
    last[rows, last.argmax(-1)] = last.min(-1).values - 1
    output.logits = logits
    return output


@contextlib.contextmanager
def disagreeing_draft(model: Any, candidates: int) -> Iterator[tuple[Any, Rollbacks]]:
    """(the draft to pass as assistant_model, the rollbacks of the model's calls while the block runs): the draft
    shares the model's modules and the hooks already on it (a plant, posdiag's slip), proposes every odd position's
    runner-up, and drafts `candidates` tokens a step."""
    draft = copy.copy(model)  # the same modules, parameters and generation config; hook tables of its own below
    for table in HOOK_TABLES:  # a table a later torch renames or drops is simply not there to copy
        if isinstance(getattr(model, table, None), dict):
            setattr(draft, table, OrderedDict(getattr(model, table)))
    draft.register_forward_hook(runner_up, with_kwargs=True)
    # id(cache) -> (the cache, the length the model's last call left it at). The cache is held while the block runs: a
    # cache freed and its id given to the next call's new cache would read that call's prefill as a rollback.
    counted, ends = Rollbacks(), {}

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = _cache_in(kwargs)
        past = _length(cache)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if past is None or not isinstance(ids, torch.Tensor):
            return
        counted.calls += 1
        _, end = ends.get(id(cache), (None, None))
        if end is not None and past < end:
            counted.crops, counted.rejected = counted.crops + 1, counted.rejected + end - past
        ends[id(cache)] = (cache, past + ids.shape[1])

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with drafts_set(model, candidates):
            yield draft, counted
    finally:
        handle.remove()
        ends.clear()
