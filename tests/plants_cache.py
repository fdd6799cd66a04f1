"""Planted KV-cache and generation position bugs (test support for `cache` and `generate`).

Each builder mutates one model *instance* (hooks and instance attributes only: nothing global
is patched, other instances and other tests are unaffected) and returns it.

- `rotate_decode_off_by_one`: single-token decode steps are positioned at past_len + 1
  (flash-linear-attention #766, onnxruntime-genai #2354). RoPE: a pre-hook on every rotary
  module adds 1 to position_ids when q_len == 1; learned tables: the same on the table lookup.
- `window_by_buffer_length`: the cache reports the length of its *buffer* as the tokens seen
  (mlx-lm #1673): a sliding layer's buffer stops growing at the window, a static buffer is
  max_cache_len long from the start. Full layers: positions (arange + get_seq_length) follow
  the buffer; sliding layers: the window's key offset (get_mask_sizes) follows the buffer
  while the query offset stays right, so the window is misplaced once it is full.
- `generation_positions_off_by_one`: generate's decode-step position_ids are numbered one
  higher than the forward pass numbers them (prepare_inputs_for_generation patched on the
  instance); the forward pass itself is untouched.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]


def _position_tables(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules()
            if name.split(".")[-1] in ("wpe", "position_embeddings") and isinstance(m, torch.nn.Embedding)]


def rotate_decode_off_by_one(model: torch.nn.Module) -> torch.nn.Module:
    """Decode steps (q_len == 1) see position_ids + 1; prefill and multi-token chunks are right."""

    def rotary_hook(module, args, kwargs):
        if "position_ids" in kwargs:
            pos = kwargs["position_ids"]
            if pos is not None and pos.shape[-1] == 1:
                kwargs["position_ids"] = pos + 1
        elif len(args) >= 2 and args[1].shape[-1] == 1:
            args = (args[0], args[1] + 1, *args[2:])
        return args, kwargs

    def table_hook(module, args, kwargs):
        pos = args[0] if args else kwargs["input"]
        if pos.shape[-1] == 1:
            return (pos + 1, *args[1:]), kwargs
        return args, kwargs

    hooked = 0
    for module in _rotary_modules(model):
        module.register_forward_pre_hook(rotary_hook, with_kwargs=True)
        hooked += 1
    if not hooked:
        for module in _position_tables(model):
            module.register_forward_pre_hook(table_hook, with_kwargs=True)
            hooked += 1
    if not hooked:
        raise RuntimeError(f"rotate_decode_off_by_one: no rotary module or position table in {type(model).__name__}")
    return model


def _buffer_length(layer: Any) -> int:
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None or keys.numel() == 0:
        return 0
    return int(keys.shape[-2])


def _patch_layer(layer: Any) -> None:
    if getattr(layer, "_planted_buffer_length", False):
        return
    layer._planted_buffer_length = True
    if not getattr(layer, "is_sliding", False):  # full layers: positions follow the buffer (static: max_cache_len)
        layer.get_seq_length = lambda: _buffer_length(layer)
    else:  # sliding layers: the window is placed by the buffer; the query offset stays right
        window = getattr(layer, "sliding_window", None) or layer.max_cache_len

        def get_mask_sizes(query_length: int) -> tuple[int, int]:
            seen = _buffer_length(layer)  # the bug: the buffer stands in for the tokens seen
            offset = max(seen - window + 1, 0)
            if seen >= window:
                return window + query_length - 1, offset
            return seen + query_length, offset

        layer.get_mask_sizes = get_mask_sizes


def _patch_cache(cache: Any) -> None:
    for inner in (getattr(cache, "self_attention_cache", None), cache):
        for layer in getattr(inner, "layers", None) or ():
            _patch_layer(layer)


def window_by_buffer_length(model: torch.nn.Module) -> torch.nn.Module:
    """Every cache handed to this model counts tokens by its buffer length (see module doc)."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is not None:
            _patch_cache(cache)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def generation_positions_off_by_one(model: torch.nn.Module) -> torch.nn.Module:
    """generate() hands decode steps position_ids one higher than the forward pass would use."""
    original = model.prepare_inputs_for_generation
    key = "decoder_position_ids" if model.config.is_encoder_decoder else "position_ids"

    def prepare(self, *args, **kwargs):
        inputs = original(*args, **kwargs)
        pos = inputs.get(key)
        if pos is not None and pos.shape[-1] == 1:
            inputs[key] = pos + 1
        return inputs

    model.prepare_inputs_for_generation = types.MethodType(prepare, model)
    return model


def generation_positions_ignore_padding(model: torch.nn.Module) -> torch.nn.Module:
    """generate() numbers every row 0, 1, 2, ... from the first (padding) column instead of from
    each row's first real token (transformers #3021/#18478, nnsight #672). A left-padded row is
    then shifted by its padding: visible with learned tables, invisible with RoPE (relative)."""
    original = model.prepare_inputs_for_generation
    key = "decoder_position_ids" if model.config.is_encoder_decoder else "position_ids"

    def prepare(self, *args, **kwargs):
        inputs = original(*args, **kwargs)
        pos = inputs.get(key)
        cache = inputs.get("cache")
        if pos is not None:
            past = int(cache.get_seq_length()) if cache is not None else 0
            row = torch.arange(past, past + pos.shape[-1], device=pos.device, dtype=pos.dtype)
            inputs[key] = row.expand_as(pos).clone()
        return inputs

    model.prepare_inputs_for_generation = types.MethodType(prepare, model)
    return model


def continuation_one_early(model: torch.nn.Module) -> torch.nn.Module:
    """A forward that continues a cache without position_ids numbers its tokens from the cache length - 1 (a chunked
    prefill or decode step one position early: moeut PR #6, mlx-vlm #1983's class); the first forward and every call
    given position_ids are right. A forward pre-hook on the model instance writes the wrong position_ids."""
    from posdiag.model.caches import cache_keyword

    keyword = cache_keyword(model)

    def hook(module, args, kwargs):
        cache = kwargs.get(keyword)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("position_ids") is not None or cache is None or ids is None:
            return args, kwargs
        past = int(cache.get_seq_length())
        if past > 0:
            kwargs["position_ids"] = torch.arange(past - 1, past - 1 + ids.shape[-1], device=ids.device)[None]
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model
