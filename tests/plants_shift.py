"""Planted RoPE bugs for the shift check, each on one model instance (test support, not shipped).

Every plant changes only the instance it is given: forward hooks, or the modeling module's
`apply_rotary_pos_emb` swapped in for the duration of *this* model's forward (pre-hook swaps,
an always-called forward hook restores), so other models in the same process are untouched.

- keys_never_rotated:   q rotated, k left as projected (BUGS D: q rotated but k not).
- layout_mismatch:      q in the model's own layout, k paired the other way (rotate-half vs
                        interleaved: BUGS D, mlx-examples #170, llama.cpp #13261).
- absolute_leak:        a learned position table added to the token embeddings on top of RoPE.
- bf16_angles:          cos/sin computed in bfloat16 (autocast in the rotary module, BUGS C:
                        transformers PR #29285); GPT-J: its sin/cos table stored in bfloat16.
- bf16_positions:       only the position values go through bfloat16 before fp32 angle math
                        (gpt-neox #1003: `t` in half precision; exact up to 256, then rounded).
- identity_rotation:    the rotary module returns cos = 1, sin = 0: RoPE declared, positions move nothing.
- rotary_ignores_position_ids: the rotary module sees 0..T-1 whatever position_ids the caller passed.
- temperature_by_position_ids: Llama 4's temperature tuning read from the position ids (vLLM's way): no bug, a
                        healthy model with a term absolute by design.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def _modeling(model: torch.nn.Module):
    return sys.modules[type(model).__module__]


def _swap_during_forward(model: torch.nn.Module, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace modeling.<name> while this model runs (restored even if the forward raises)."""
    module = _modeling(model)
    saved: dict = {}

    def pre(_m, args, kwargs):
        saved["f"] = getattr(module, name)
        setattr(module, name, make(saved["f"]))

    def post(_m, args, kwargs, out):
        if "f" in saved:
            setattr(module, name, saved.pop("f"))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=True)


def _interleaved(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (0,1), (2,3), ... of the last dim; cos_half/sin_half hold one value per pair."""
    c = cos_half.repeat_interleave(2, dim=-1)
    s = sin_half.repeat_interleave(2, dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * c + rotated * s


def _split_half(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2): the rotate-half layout."""
    c, s = torch.cat((cos_half, cos_half), -1), torch.cat((sin_half, sin_half), -1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * c + rotated * s


def _is_gptj(model: torch.nn.Module) -> bool:
    return getattr(model.config, "model_type", "") == "gptj"


def keys_never_rotated(model: torch.nn.Module) -> torch.nn.Module:
    if hasattr(_modeling(model), "apply_rotary_emb"):  # Llama 4: apply_rotary_emb(xq, xk, freqs_cis), complex
        def make(orig):
            def apply(xq, xk, freqs_cis):
                return orig(xq, xk, freqs_cis)[0], xk
            return apply
        _swap_during_forward(model, "apply_rotary_emb", make)
        return model
    if _is_gptj(model):  # apply_rotary_pos_emb(tensor, sin, cos), called for k then q in each layer
        def make(orig):
            calls = [0]

            def apply(tensor, sin, cos):
                calls[0] += 1
                return tensor if calls[0] % 2 == 1 else orig(tensor, sin, cos)
            return apply
    else:
        def make(orig):
            def apply(q, k, cos, sin, *args, **kwargs):
                q_embed, _ = orig(q, k, cos, sin, *args, **kwargs)
                return q_embed, k
            return apply
    _swap_during_forward(model, "apply_rotary_pos_emb", make)
    return model


def layout_mismatch(model: torch.nn.Module) -> torch.nn.Module:
    if _is_gptj(model):  # native interleaved: give k the rotate-half layout instead
        def make(orig):
            calls = [0]

            def apply(tensor, sin, cos):
                calls[0] += 1
                if calls[0] % 2 == 0:
                    return orig(tensor, sin, cos)
                return _split_half(tensor, cos[:, :, None, :], sin[:, :, None, :])
            return apply
    else:  # native rotate-half: k paired interleaved over the rotary dims
        def make(orig):
            def apply(q, k, cos, sin, unsqueeze_dim=1):
                q_embed, _ = orig(q, k, cos, sin, unsqueeze_dim)
                c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
                rd = c.shape[-1]
                k_rot = _interleaved(k[..., :rd], c[..., : rd // 2], s[..., : rd // 2])
                return q_embed, torch.cat((k_rot, k[..., rd:]), -1)
            return apply
    _swap_during_forward(model, "apply_rotary_pos_emb", make)
    return model


def absolute_leak(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A learned table, drawn like the model's own weights, added at each position id."""
    emb = model.get_input_embeddings()
    rows = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None) or 1024
    std = getattr(model.config, "initializer_range", 0.02)
    gen = torch.Generator().manual_seed(seed + 17)
    table = torch.randn(rows, emb.embedding_dim, generator=gen) * std
    state: dict = {}

    def capture(_m, args, kwargs):
        state["pos"] = kwargs.get("position_ids")

    def add(_m, args, out):
        pos = state.get("pos")
        if pos is None:
            pos = torch.arange(out.shape[1], device=out.device)[None]
        return out + table.to(out.device, out.dtype)[pos]

    model.register_forward_pre_hook(capture, with_kwargs=True)
    emb.register_forward_hook(add)
    return model


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not found:
        raise RuntimeError(f"no rotary module in {type(model).__name__}")
    return found


def _recompute_rotary(model: torch.nn.Module, angles: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace the cos/sin a Llama-style rotary module returns by ones built from angles(inv_freq, pos)."""
    for rotary in _rotary_modules(model):
        def hook(module, args, kwargs, out):
            pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            freqs = angles(module.inv_freq, pos)  # [B, T, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = getattr(module, "attention_scaling", 1.0)
            cos, sin = out
            return (emb.cos() * scale).to(cos.dtype), (emb.sin() * scale).to(sin.dtype)
        rotary.register_forward_hook(hook, with_kwargs=True)


def bf16_angles(model: torch.nn.Module) -> torch.nn.Module:
    """Angles and cos/sin in bfloat16 (inv_freq, positions and their product), cast back to fp32."""
    if _is_gptj(model):
        for rotary in _rotary_modules(model):
            rotary.embed_positions.copy_(rotary.embed_positions.to(torch.bfloat16).float())
        return model

    def angles(inv_freq, pos):
        inv = inv_freq.to(torch.bfloat16)
        return (pos.to(torch.bfloat16)[:, :, None] * inv[None, None, :])  # bf16 product

    _recompute_rotary(model, angles)  # cos/sin of a bf16 tensor are bf16: cast back to fp32 after
    return model


def bf16_positions(model: torch.nn.Module) -> torch.nn.Module:
    """Position values rounded to bfloat16 (exact up to 256), angle math in float32 after that."""
    _recompute_rotary(model, lambda inv_freq,
                      pos: pos.to(torch.bfloat16).float()[:, :, None] * inv_freq.float()[None, None, :])
    return model


def demo_bf16_positions() -> torch.nn.Module:
    """For docs/checks.md (shift): `posdiag check tests.plants_shift:demo_bf16_positions --only shift`."""
    from posdiag.testing import zoo

    return bf16_positions(zoo.tiny_model("llama", max_position_embeddings=4096))


def identity_rotation(model: torch.nn.Module) -> torch.nn.Module:
    """The rotary module returns cos = 1, sin = 0: every position gets the identity rotation, so the
    model declares RoPE yet its positions move nothing (a rotary table never filled, a zeroed inv_freq)."""
    for rotary in _rotary_modules(model):
        def hook(_module, _args, out):
            cos, sin = out
            return torch.ones_like(cos), torch.zeros_like(sin)
        rotary.register_forward_hook(hook)
    return model


def rotary_ignores_position_ids(model: torch.nn.Module) -> torch.nn.Module:
    """The rotary module is handed 0..T-1 whatever position_ids say (cos/sin sliced by sequence length, the
    way older ports build them): ids passed by the caller never reach attention."""
    for rotary in _rotary_modules(model):
        def pre(_module, args, kwargs):
            args = list(args)
            pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            arange = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
            if "position_ids" in kwargs:
                kwargs["position_ids"] = arange
            else:
                args[1] = arange
            return tuple(args), kwargs
        rotary.register_forward_pre_hook(pre, with_kwargs=True)
    return model


def temperature_by_position_ids(model: torch.nn.Module) -> torch.nn.Module:
    """Llama 4's attention temperature tuning numbered by the position ids, as vLLM numbers it (transformers numbers
    it by the token's index in the sequence): log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 on the queries of
    each NoPE layer, read from the attention's own floor_scale and attn_scale. Not a bug: absolute by design. On a NoPE
    layer nothing acts on the queries between q_proj and that scale, so it scales q_proj's output."""
    state: dict = {}

    def capture(_m, args, kwargs):
        state["pos"] = kwargs.get("position_ids")

    layers = model.model.layers
    for layer in layers:
        attn = layer.self_attn
        if attn.use_rope or not attn.attn_temperature_tuning:
            continue
        attn.attn_temperature_tuning = False  # transformers' own (by sequence index) gives way to this one

        def scale(q_proj, args, out, attn=attn):
            pos = state["pos"]
            if pos is None:
                pos = torch.arange(out.shape[1], device=out.device)[None]
            factor = torch.log1p(torch.floor((pos.float() + 1.0) / attn.floor_scale)) * attn.attn_scale + 1.0
            return (out * factor[..., None]).to(out.dtype)
        attn.q_proj.register_forward_hook(scale)
    layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    return model


def demo_identity_rotation() -> torch.nn.Module:
    """For docs/checks.md (shift): `posdiag check tests.plants_shift:demo_identity_rotation --only shift`."""
    from posdiag.testing import zoo

    return identity_rotation(zoo.tiny_model("llama"))
