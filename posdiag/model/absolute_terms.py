"""Absolute-by-design terms (`Family.absolute_by_design`) that can be held constant, so that `shift` judges what
is relative in a family that also reads absolute positions.

A row's `hold_absolute(model) -> (what was held, undo)` sets the term to the value it has at the first positions,
on this instance only; ("", no-op) when the model has no such module (a port that names it otherwise: the row's
n/a by design then applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def temperature_tuning(model: Any) -> tuple[str, Callable[[], None]]:
    """Llama 4's attention temperature tuning multiplies the queries of its NoPE layers by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1. With attn_scale 0 that is exactly 1, its value at every
    position below floor_scale - 1, wherever p comes from (transformers: the token's index in the sequence, cache
    included; vLLM: the position ids)."""
    held = [(m, m.attn_scale) for m in (model.modules() if hasattr(model, "modules") else ())
            if all(isinstance(getattr(m, name, None), (int, float)) for name in ("floor_scale", "attn_scale"))
            and not getattr(m, "use_rope", False)]
    for module, _ in held:
        module.attn_scale = 0.0

    def undo() -> None:
        for module, scale in held:
            module.attn_scale = scale
    if not held:
        return "", undo
    return (f"held at 1, its value below position {held[0][0].floor_scale - 1} (attn_scale 0 in {len(held)} NoPE "
            f"attention module{'s' if len(held) > 1 else ''})"), undo


def llama_4_scaling_beta(model: Any) -> tuple[str, Callable[[], None]]:
    """Ministral 3 and Mistral 4 multiply their queries by 1 + beta * log(1 + floor(p / original_max_position_
    embeddings)) of the position ids, beta read from config.rope_parameters at every forward (get_llama_4_attn_scale).
    beta 0 makes it exactly 1, its value below original_max_position_embeddings."""
    found = {id(p): p for m in (model.modules() if hasattr(model, "modules") else ())
             if isinstance(p := getattr(getattr(m, "config", None), "rope_parameters", None), dict)
             and p.get("llama_4_scaling_beta")}
    saved = [(p, p["llama_4_scaling_beta"]) for p in found.values()]
    for parameters, _ in saved:
        parameters["llama_4_scaling_beta"] = 0.0

    def undo() -> None:
        for parameters, beta in saved:
            parameters["llama_4_scaling_beta"] = beta
    if not saved:
        return "", undo
    below = saved[0][0].get("original_max_position_embeddings")
    return f"held at 1, its value below position {below} (llama_4_scaling_beta 0)", undo


def softmax_scaling(model: Any) -> tuple[str, Callable[[], None]]:
    """Mistral Large 4 multiplies its queries by scale * log(p + 1) + bias per head, learned (MistralLarge4TextSoftmax
    Scaling, p the position ids). scale 0 holds it at bias, its value at position 0."""
    import torch

    held = [(m, m.scale.detach().clone()) for m in (model.modules() if hasattr(model, "modules") else ())
            if type(m).__name__.endswith("SoftmaxScaling") and isinstance(getattr(m, "scale", None), torch.Tensor)]
    with torch.no_grad():
        for module, _ in held:
            module.scale.zero_()

    def undo() -> None:
        with torch.no_grad():
            for module, scale in held:
                module.scale.copy_(scale)
    if not held:
        return "", undo
    return f"held at its value at position 0 (the coefficient of log(p + 1) zeroed in {len(held)} modules)", undo
