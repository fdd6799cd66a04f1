"""A module's Python state (public attributes, buffers, which buffers are non-persistent), saved and put back.

Rotary modules keep their frequencies in non-persistent buffers and attributes that probes change: dynamic/longrope
modules rewrite them when run long (`rope`), and `fit` swaps in the frequencies of another configuration. Both put
every such module back exactly as it was, attributes a probe added removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModuleState:
    attributes: dict[str, Any]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: frozenset[str]


def saved_state(module: torch.nn.Module, clone: bool = False) -> ModuleState:
    """The module's state; `clone` copies the buffers (for a module whose buffers are written in place)."""
    buffers = {k: (None if v is None else v.detach().clone()) if clone else v for k, v in module._buffers.items()}
    return ModuleState({k: v for k, v in module.__dict__.items() if _is_state(k)}, buffers,
                       frozenset(module._non_persistent_buffers_set))


def _is_state(key: str) -> bool:
    """A public attribute is state; an instance `forward` is not: it is posdiag's own float64 conversion of a large
    linear layer (conversion.streamed_dtype), installed and removed around a re-run. Restored as state mid-re-run
    (`state` puts the model back between its calls), it was deleted under the conversion, whose removal then raised
    (AttributeError: 'Linear' object has no attribute 'forward': `state` on the real SmolLM2 in bfloat16)."""
    return not key.startswith("_") and key != "forward"


def restore_state(module: torch.nn.Module, state: ModuleState) -> None:
    for key in [k for k in module.__dict__ if _is_state(k) and k not in state.attributes]:
        delattr(module, key)
    module.__dict__.update(state.attributes)
    module._buffers.clear()
    module._buffers.update(state.buffers)
    module._non_persistent_buffers_set.clear()
    module._non_persistent_buffers_set.update(state.non_persistent)


@dataclass(frozen=True)
class ModelState:
    """Every module's state (buffers cloned): what `restored` puts back and `changes` compares against."""

    modules: tuple[tuple[str, torch.nn.Module, ModuleState], ...]


def snapshot(model: torch.nn.Module) -> ModelState:
    """The state of every module of `model`, buffers copied (a later in-place write leaves the snapshot as it was)."""
    return ModelState(tuple((name, module, saved_state(module, clone=True)) for name, module in model.named_modules()))


def restored(state: ModelState) -> None:
    """Every module put back as it was when `state` was taken (a copy of each buffer: the snapshot stays usable)."""
    for _, module, saved in state.modules:
        buffers = {k: None if v is None else v.clone() for k, v in saved.buffers.items()}
        restore_state(module, ModuleState(dict(saved.attributes), buffers, saved.non_persistent))


def changes(state: ModelState, limit: int = 4) -> list[str]:
    """What differs now from `state`, one phrase each (up to `limit`): a buffer whose values or shape changed, a
    public attribute that changed, appeared or went away. Parameters are not state: they are never compared."""
    found: list[str] = []
    for name, module, saved in state.modules:
        where = f"{name}." if name else ""
        for key in sorted(set(saved.buffers) | set(module._buffers)):
            before, now = saved.buffers.get(key), module._buffers.get(key)
            if not _same_tensor(before, now):
                found.append(f"{where}{key} changed (buffer)")
        now_attrs = {k: v for k, v in module.__dict__.items() if _is_state(k)}
        for key in sorted(set(saved.attributes) | set(now_attrs)):
            if key in ("training",):
                continue
            before, now = saved.attributes.get(key, _ABSENT), now_attrs.get(key, _ABSENT)
            if not _same_value(before, now):
                found.append(f"{where}{key} {_shown(before)} -> {_shown(now)}")
        if len(found) >= limit:
            break
    return found[:limit]


_ABSENT = object()


def _same_tensor(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return a.is_meta or bool(torch.equal(a, b))


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if a is _ABSENT or b is _ABSENT:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        try:
            return bool(a == b)
        except Exception:  # a tuple holding tensors: compared by identity above
            return False
    # Another object (a config, a function) is not compared by value, only by kind: a call that replaced None by an
    # object (a kept cache, rope_deltas) changed the state.
    return type(a) is type(b)


_PLAIN = (int, float, str, bool, type(None), tuple, list, dict)


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if isinstance(value, torch.Tensor):
        return f"{value.item():g}" if value.numel() == 1 and not value.is_meta else f"tensor{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."
