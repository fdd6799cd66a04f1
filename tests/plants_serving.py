"""Planted serving bugs for the `serving` check, each with its healthy twin, on tiny zoo models in memory.

Each plant is a forward pre-hook on the top module that numbers positions the way a serving stack's bug numbers them
(the healthy twin runs the same hook with the bookkeeping right):
- rope_deltas: the model works out a per-row position offset at each prefill from the padding (Qwen2-VL's
  `rope_deltas`, text only: minus the row's pad count) and adds it to the cache length at every decode step taken
  without position_ids. `reset="never"`: the offset of the first padded batch is kept for every later request
  (transformers #36013 class); `reset="batch size"`: worked out again only when the batch size changes;
  `reset="padded"`: worked out only at a padded prefill, so an unpadded request after a padded batch keeps its
  offsets (row r of a call takes the kept offset of row r modulo the kept batch); twin `reset="prompt"`: worked out
  at every prefill.
- chunk_restart: a multi-token forward against a non-empty cache numbered from 0 (each chunk of a chunked prefill
  given the positions of a prompt of its own: mlx-vlm #1741). Twin: numbered from the cache length.
- continued_early: a forward that continues a cache without position_ids numbers its tokens from cache length - 1
  (the issue's SmolLM2 plant: invisible to a bfloat16 floor, logits moved by 7). Twin: from the cache length.
- prefix_slot: a cache the model did not fill itself (a stored prefix, copied and continued) continued one slot off
  (vllm-mlx #311). Twin: continued at its length.
- drafts_off: after a cache was cropped (rejected drafts rolled back) the next positions are one off (vLLM #54498
  class). Twin: numbered from the cropped length.
- stale_crop: a cache cropped after rejected drafts keeps one of them (the verification after a rollback attends a
  token that was rejected, and is numbered past it). Twin: cropped as asked.
- rows_offset: in a batch decoding from a cache, rows after the first lose the cache offset (MLX #3949: fast RoPE's
  offset right for row 0 only). Twin: every row keeps it. (Row 0's position_ids handed to every row would not do: a
  left-padded row's positions are then shifted by a constant, which RoPE cannot see.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def _cache_of(kwargs: dict) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _past(kwargs: dict) -> int:
    cache = _cache_of(kwargs)
    return 0 if cache is None else int(cache.get_seq_length())


def _ids(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs.get("input_ids", args[0] if args else None)


def _numbered(ids: torch.Tensor, start: Any) -> torch.Tensor:
    """Positions start + 0..n-1 per row (`start` an int or a [B] tensor)."""
    steps = torch.arange(ids.shape[1], device=ids.device)[None]
    start = torch.as_tensor(start, device=ids.device).reshape(-1, 1)
    return (start + steps).expand(ids.shape[0], -1)


def rope_deltas(model: torch.nn.Module, *, reset: str) -> torch.nn.Module:
    """Positions without position_ids: a prefill counts each row's real tokens (the mask's cumsum) and stores the
    row's offset (minus its pad count); a decode step is the cache length plus the stored offset. `reset`: "prompt"
    (healthy), "batch size", "padded" or "never" (see the module doc)."""
    assert reset in ("prompt", "batch size", "padded", "never")
    model.rope_deltas = None

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is not None:
            return args, kwargs
        ids, past = _ids(args, kwargs), _past(kwargs)
        mask = kwargs.get("attention_mask")
        if past == 0:
            mask = torch.ones_like(ids) if not isinstance(mask, torch.Tensor) or mask.dim() != 2 else mask
            counted = mask.long().cumsum(-1) - 1
            kept = module.rope_deltas
            if kept is None or reset == "prompt" or (reset == "batch size" and kept.shape[0] != ids.shape[0]) or (
                    reset == "padded" and not bool(mask.all())):
                module.rope_deltas = counted.max(-1).values + 1 - ids.shape[1]
            kwargs["position_ids"] = counted.clamp_min(0)
        else:
            deltas = module.rope_deltas
            rows = torch.arange(ids.shape[0], device=deltas.device) % deltas.shape[0]
            kwargs["position_ids"] = _numbered(ids, past + deltas[rows])
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def chunk_restart(model: torch.nn.Module, *, restart: bool) -> torch.nn.Module:
    """A forward of several tokens against a non-empty cache: numbered from 0 (`restart`) or from the cache length."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids, past = _ids(args, kwargs), _past(kwargs)
        if past > 0 and ids.shape[1] > 1:
            kwargs["position_ids"] = _numbered(ids, 0 if restart else past)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def continued_early(model: torch.nn.Module, *, early: int) -> torch.nn.Module:
    """A forward on a non-empty cache without position_ids numbered from the cache length - `early` (0: the twin)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids, past = _ids(args, kwargs), _past(kwargs)
        if past > 0 and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = _numbered(ids, past - early)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def prefix_slot(model: torch.nn.Module, *, off: int) -> torch.nn.Module:
    """A cache first seen holding tokens (a copied prefix: a prefix-cache hit) is continued `off` slots from its
    length on every call (0: the healthy twin)."""
    model.filled, model.hits = weakref.WeakSet(), weakref.WeakSet()

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache, ids, past = _cache_of(kwargs), _ids(args, kwargs), _past(kwargs)
        if cache is None:
            return args, kwargs
        if past > 0 and cache not in module.filled:
            module.hits.add(cache)
        module.filled.add(cache)
        if cache in module.hits:
            kwargs["position_ids"] = _numbered(ids, past + off)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def drafts_off(model: torch.nn.Module, *, off: int) -> torch.nn.Module:
    """After a cache was cropped below the length the model last left it at (rejected drafts rolled back), every
    later call on it is numbered `off` slots from its length (0: the healthy twin)."""
    model.ends, model.rolled = weakref.WeakKeyDictionary(), weakref.WeakSet()

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache, ids, past = _cache_of(kwargs), _ids(args, kwargs), _past(kwargs)
        if cache is None:
            return args, kwargs
        if past < module.ends.get(cache, 0):
            module.rolled.add(cache)
        module.ends[cache] = past + ids.shape[1]
        if cache in module.rolled:
            kwargs["position_ids"] = _numbered(ids, past + off)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def stale_crop(model: torch.nn.Module, *, stale: int) -> torch.nn.Module:
    """Every cache the model is handed crops `stale` fewer tokens than asked (0: the healthy twin): only a rollback of
    rejected drafts crops, so only assisted and prompt-lookup decoding that reject drafts reach it."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = _cache_of(kwargs)
        if cache is None or getattr(cache, "planted_crop", False):
            return
        original = cache.crop

        def crop(tokens_to_remove: int) -> None:  # transformers crops by a negative count
            original(min(0, tokens_to_remove + stale))

        cache.crop, cache.planted_crop = crop, True

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def rows_offset(model: torch.nn.Module, *, dropped: bool) -> torch.nn.Module:
    """In a batch against a non-empty cache, rows after the first lose the cache offset (`dropped`: numbered as if
    their step were their first tokens), or every row keeps it (the twin: the positions passed, else the cache
    length on)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids, past = _ids(args, kwargs), _past(kwargs)
        if ids.shape[0] < 2 or past == 0:
            return args, kwargs
        given = kwargs.get("position_ids")
        positions = _numbered(ids, past) if given is None else given.clone()
        if dropped:
            positions[1:] -= past
        kwargs["position_ids"] = positions
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def demo_rope_deltas() -> torch.nn.Module:
    """For docs/checks.md (serving): `posdiag check tests.plants_serving:demo_rope_deltas --only serving`."""
    from posdiag.testing import zoo

    return rope_deltas(zoo.tiny_model("qwen2"), reset="batch size")
