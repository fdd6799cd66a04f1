"""Injectors: how a family whose layers do not (only) read attention_mask is handed an attention pattern.

A row of posdiag.model.families names one as its `injector`: fn(subject, patterns) -> undo. Each imports torch
lazily (the quirk table is read before torch is needed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def causal_buffers(subject: Any, patterns: dict) -> Callable[[], None]:
    """GPT-Neo and OpenAI GPT fold a hard-coded causal `bias` buffer [1,1,N,N] into the scores
    (GPT-Neo: where(bias, w, min) before adding attention_mask; OpenAI GPT: w*bias - 1e4*(1-bias),
    and it takes 2D padding masks only), so a mask can block but never open a key (measured on
    GPT-Neo: opening a future key changed 0.0). Filling the buffer with True opens it but drops
    GPT-Neo's local window (0.49 off the default). So each layer's buffer is swapped for the per-row
    pattern [B,1,T,T] in the buffer's dtype (it broadcasts over heads), windowed where
    attention_type == "local"."""
    import torch

    saved = []
    for module in subject.model.modules():
        buf = dict(module.named_buffers(recurse=False)).get("bias")
        if isinstance(buf, torch.Tensor) and buf.ndim == 4 and buf.shape[-1] == buf.shape[-2]:
            saved.append((module, buf))
            key = "sliding" if getattr(module, "attention_type", None) == "local" and "sliding" in patterns else "full"
            module.bias = patterns[key][:, None].to(buf.dtype)

    def undo() -> None:
        for module, buf in saved:
            module.bias = buf
    return undo


def layer_mask_hook(build: Callable[[Any, dict, dict], Any]) -> Callable[[Any, dict], Callable[[], None]]:
    """Bloom and Falcon-alibi build their ALiBi bias from a 2D padding mask and crash on a 4D one
    (ValueError: too many values to unpack). The model gets no mask (ALiBi from arange key
    positions, as in training) and a forward pre-hook on each block replaces the layer's
    attention_mask with ours."""
    def inject(subject: Any, patterns: dict) -> Callable[[], None]:
        def hook(module, args, kwargs):
            kwargs["attention_mask"] = build(subject, patterns, kwargs)
            return args, kwargs
        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in _blocks(subject.model)]
        return lambda: [h.remove() for h in handles]
    return inject


def _blocks(model: Any) -> Any:
    """Bloom's and Falcon's decoder blocks (`transformer.h`), or a SKIP naming what moved."""
    from posdiag.errors import InternalsChanged

    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if blocks is None:
        raise InternalsChanged(f"where {type(model).__name__} keeps its decoder blocks (no transformer.h)")
    return blocks


def bloom_mask(subject: Any, patterns: dict, kwargs: dict) -> Any:
    from posdiag.model.tensors import additive_mask
    return additive_mask(patterns["full"][:, None], subject.dtype)


def falcon_alibi_mask(subject: Any, patterns: dict, kwargs: dict) -> Any:
    """FalconModel folds alibi/sqrt(head_dim) into the float mask it hands the blocks; rebuild that with our pattern.

    The model's own bias is read, never recomputed (a model whose ALiBi is broken must show it): the block's `alibi`
    kwarg where FalconModel passes it (transformers <= 5.24), else the mask FalconModel hands the block (5.25
    stopped passing `alibi`: the mask carries it). Called without padding, that mask's last query row sees every
    key, so it is the bias by key, [B, H, Tk]."""
    import torch
    full = patterns["full"]  # [B, Tq, Tk]
    bias = _falcon_bias_by_key(subject, kwargs)  # [B, H, 1, Tk]
    bias = bias.expand(full.shape[0], -1, full.shape[1], -1).to(subject.dtype)
    return bias.masked_fill(~full[:, None], torch.finfo(subject.dtype).min)


def _falcon_bias_by_key(subject: Any, kwargs: dict) -> Any:
    import math

    from posdiag.errors import InternalsChanged
    heads = subject.config.num_attention_heads
    alibi = kwargs.get("alibi")
    if alibi is not None:
        if alibi.ndim == 3:  # [B*H, 1, Tk] as built; FalconModel <= 5.24 hands the blocks [B, H, 1, Tk]
            alibi = alibi.reshape(-1, heads, *alibi.shape[1:])
        return alibi / math.sqrt(subject.config.hidden_size // heads)
    mask = kwargs.get("attention_mask")
    if mask is None or not mask.is_floating_point() or mask.ndim != 4 or mask.shape[1] != heads:
        raise InternalsChanged("how Falcon-ALiBi hands its bias to the blocks (no `alibi` kwarg, and the block's "
                               "attention_mask is not the float [B, heads, Tq, Tk] bias)")
    return mask[:, :, -1:, :]
