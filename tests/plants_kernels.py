"""Planted kernel bugs for the `kernels` check (test support; nothing here is imported by posdiag).

- drop_padding_mask(model): the instance's sdpa path loses its mask (BUGS.md H: "a path that drops
  the padding mask, is_causal=True instead of the mask"). A forward pre-hook on every attention
  module clears `attention_mask` while the model runs sdpa, so transformers' sdpa_attention_forward
  falls back to is_causal (decoders) or no mask at all (encoders). Eager is untouched: the bug only
  shows on padded inputs (and on decode chunks, where is_causal is top-left aligned).
- register_bad_scale(): a fused path with a wrong softmax scale (1/head_dim instead of the module's
  own scaling), registered with transformers' AttentionInterface under its own name.
- register_nan_rows(): a fused path that returns NaN for fully masked (padding) query rows, the
  PyTorch #103749 / transformers #38690 behaviour; the NaN then reaches valid tokens in the next
  layer through 0 · NaN.
- register_sdpa_copy(): the healthy twin of the registered ones: plain sdpa under a new name.
- register_rounding(): sdpa off by 32 units of its dtype: over the 2x rule, yet shrinking with precision.
- register_half_only_mask_drop(): sdpa that drops the padding mask on half-precision inputs only (a fused
  half-precision path that takes no mask): right in float32 and float64, wrong as bfloat16 runs.
Every registered name also gets transformers' sdpa mask builder (without one, transformers hands a
custom implementation no mask at all).
"""

from __future__ import annotations

import math

import torch

BAD_SCALE = "posdiag_plant_bad_scale"
NAN_ROWS = "posdiag_plant_nan_rows"
SDPA_COPY = "posdiag_plant_sdpa_copy"


def drop_padding_mask(model: torch.nn.Module) -> list:
    """Clear attention_mask in every attention module while the model runs sdpa. Returns the hook handles."""

    def hook(module, args, kwargs):
        config = getattr(module, "config", None)
        if config is not None and config._attn_implementation == "sdpa" and "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
        return args, kwargs

    handles = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Attention") and getattr(module, "config", None) is not None:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise RuntimeError(f"no attention modules with a config found in {type(model).__name__}")
    return handles


def _register(name: str, fn) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def register_bad_scale() -> str:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def bad_scale(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=1.0 / query.shape[-1], **kwargs)

    _register(BAD_SCALE, bad_scale)
    return BAD_SCALE


HALF_ONLY_MASK_DROP = "posdiag_plant_half_only_mask_drop"


def register_half_only_mask_drop() -> str:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def half_only(module, query, key, value, attention_mask, **kwargs):
        if query.dtype in (torch.bfloat16, torch.float16):
            attention_mask = None  # causal order kept (sdpa's is_causal), the padding lost
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    _register(HALF_ONLY_MASK_DROP, half_only)
    return HALF_ONLY_MASK_DROP


def register_nan_rows() -> str:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def nan_rows(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if attention_mask is not None:
            blocked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < -1
            empty = blocked.all(-1)  # [B, 1 or H, Tq]: rows that see no key
            if bool(empty.any()):
                rows = empty.any(1)  # [B, Tq]
                out = out.masked_fill(rows[:, :, None, None], math.nan)  # out is [B, Tq, H, D]
        return out, weights

    _register(NAN_ROWS, nan_rows)
    return NAN_ROWS


def register_sdpa_copy() -> str:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _register(SDPA_COPY, sdpa_attention_forward)
    return SDPA_COPY


ROUNDING = "posdiag_plant_rounding"


def register_rounding() -> str:
    """Healthy, with rounding-sized differences: sdpa with its output perturbed by 32 units of its own dtype (over
    the 2x rule in float32; shrinks with precision like any summation-order difference)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounding(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
        return out * (1 + 32 * torch.finfo(out.dtype).eps * noise), weights

    _register(ROUNDING, rounding)
    return ROUNDING


def perturb_one_backend(backend: str = "math", scale: float = 1e-3):
    """A context manager: SDPA's `backend` ("math" or "flash", as pinned by torch.nn.attention.sdpa_kernel) returns
    its output off by `scale` (relative) whenever it is handed an explicit mask (the left-padded inputs); every other
    backend, and the same backend without a mask, stays right. One backend wrong in one scenario."""
    import contextlib
    from unittest import mock

    enabled = {"math": torch.backends.cuda.math_sdp_enabled, "flash": torch.backends.cuda.flash_sdp_enabled}
    others = [f for name, f in enabled.items() if name != backend]
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        out = real(query, key, value, attn_mask, *args, **kwargs)
        alone = enabled[backend]() and not any(f() for f in others)
        return out * (1 + scale) if alone and attn_mask is not None else out

    @contextlib.contextmanager
    def planted():
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
            yield
    return planted()
