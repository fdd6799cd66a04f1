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
