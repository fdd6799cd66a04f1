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
    return ModuleState({k: v for k, v in module.__dict__.items() if not k.startswith("_")}, buffers,
                       frozenset(module._non_persistent_buffers_set))


def restore_state(module: torch.nn.Module, state: ModuleState) -> None:
    for key in [k for k in module.__dict__ if not k.startswith("_") and k not in state.attributes]:
        delattr(module, key)
    module.__dict__.update(state.attributes)
    module._buffers.clear()
    module._buffers.update(state.buffers)
    module._non_persistent_buffers_set.clear()
    module._non_persistent_buffers_set.update(state.non_persistent)
