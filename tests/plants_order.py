"""Planted order/position bugs for the `positions`, `batch` and `causal` tests.

Each planter mutates ONE model instance with forward pre-hooks (nothing global is patched) and
returns the hook handles. The bugs are the ones BUGS.md sections A and H describe:

- rebuild_arange:   position_ids accepted, then replaced by arange inside (the rotary module or the
                    learned position table sees 0..T-1 whatever was passed).
- row0_positions:   every row of a batch gets row 0's position ids (unsloth #3699: one position
                    tensor shared by the batch) — position_ids[:1].expand(...).
- drop_padding_mask: the attention layers get a plain causal mask (bidirectional: none), as a path
                    that uses is_causal=True instead of the padding mask does.
- open_future:      the layers' causal mask lets query i see key i + distance (distance 1: the next
                    token; a larger distance: a mis-gathered relative mask/bias diagonal).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Where each planted family keeps the modules a planter hooks.
# (module-name suffix, position argument name, its positional index)
_POSITION_SITES = {
    "llama": ("rotary_emb", "position_ids", 1),
    "qwen2": ("rotary_emb", "position_ids", 1),
    "gpt_neox": ("rotary_emb", "position_ids", 1),
    "phi": ("rotary_emb", "position_ids", 1),
    "gpt2": ("transformer.wpe", "input", 0),
    "opt": None,
    "bert": ("embeddings.position_embeddings", "input", 0),
}
# (module-name suffix of the self-attention modules, mask keyword)
_ATTENTION_SITES = {
    "llama": ("self_attn", "attention_mask"),
    "qwen2": ("self_attn", "attention_mask"),
    "gpt_neox": ("attention", "attention_mask"),
    "gpt2": ("attn", "attention_mask"),
    "bert": ("attention.self", "attention_mask"),
    "t5": ("decoder.block.0.layer.0.SelfAttention|decoder.block.1.layer.0.SelfAttention", "mask"),
}


def _modules(model: torch.nn.Module, suffixes: str) -> list[torch.nn.Module]:
    wanted = suffixes.split("|")
    found = [m for n, m in model.named_modules() if any(n == s or n.endswith("." + s) for s in wanted)]
    if not found:
        raise RuntimeError(f"no module ending in {suffixes!r} in {type(model).__name__}")
    return found


def _rewrite_positions(model: torch.nn.Module, family: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> list:
    suffix, name, index = _POSITION_SITES[family]

    def hook(module, args, kwargs):
        if kwargs.get(name) is not None:
            kwargs[name] = fn(kwargs[name])
        elif len(args) > index and args[index] is not None:
            args = args[:index] + (fn(args[index]),) + args[index + 1:]
        return args, kwargs

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _modules(model, suffix)]


def rebuild_arange(model: torch.nn.Module, family: str) -> list:
    """position_ids ignored: the positions are rebuilt as first + arange(T) inside."""
    def arange(p: torch.Tensor) -> torch.Tensor:
        first = p.min()
        return (first + torch.arange(p.shape[-1], device=p.device)).expand_as(p).clone()
    return _rewrite_positions(model, family, arange)


def row0_positions(model: torch.nn.Module, family: str) -> list:
    """Every row of the batch gets row 0's position ids."""
    return _rewrite_positions(model, family, lambda p: p[:1].expand_as(p).clone() if p.ndim > 1 else p)


def _causal_additive(like: torch.Tensor | None, batch: int, q: int, k: int, dtype, device) -> torch.Tensor:
    allowed = torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)
    out = torch.zeros(batch, 1, q, k, dtype=dtype, device=device)
    return out.masked_fill(~allowed, torch.finfo(dtype).min)


def drop_padding_mask(model: torch.nn.Module, family: str, causal: bool = True,
                      only_dtype: torch.dtype | None = None) -> list:
    """The layers get a plain causal mask (encoders: no mask): padding keys become visible. `only_dtype`: only where
    the hidden states are of that dtype (a half-precision path of its own: the bug is gone in a finer re-run)."""
    suffix, key = _ATTENTION_SITES[family]

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if only_dtype is not None and hidden.dtype != only_dtype:
            return args, kwargs
        if not causal:
            kwargs[key] = None
            return args, kwargs
        b, t = hidden.shape[0], hidden.shape[1]
        kwargs[key] = _causal_additive(kwargs.get(key), b, t, t, hidden.dtype, hidden.device)
        return args, kwargs

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _modules(model, suffix)]


def open_future(model: torch.nn.Module, family: str, distance: int = 1, bias: float = 0.0) -> list:
    """Query i may also see key i + distance (every layer's self-attention mask), with the additive `bias` on that
    score (0: as any visible key; a large negative one: a faint leak)."""
    suffix, key = _ATTENTION_SITES[family]

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        mask = kwargs.get(key)
        b, t = hidden.shape[0], hidden.shape[1]
        if mask is None:
            mask = _causal_additive(None, b, t, t, hidden.dtype, hidden.device)
        mask = mask.clone()
        q = torch.arange(max(0, t - distance), device=mask.device)
        mask[..., q, q + distance] = bias
        kwargs[key] = mask
        return args, kwargs

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _modules(model, suffix)]
