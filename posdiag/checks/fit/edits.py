"""Applying one alternative in memory and putting the model back exactly.

Two kinds of edit, each a context manager that restores on exit:
- `rotary_rebuilt(subject, params)`: every rotary module of the language model is rebuilt by its own class from
  a deep copy of its config carrying the alternative rope_parameters (so the frequencies come from transformers'
  own init functions, scaling types included), and its buffers and attributes are swapped into the live module;
  the saved originals go back on exit. The config objects the model holds are never changed.
- `qk_permuted(subject, order)`: the q_proj/k_proj rows (and biases, and per-head q/k norm weights) of every head
  gathered by `order` in place, and gathered back by the inverse permutation on exit (a permutation copies
  values: the restored weights are bitwise the loaded ones).

An edit that cannot be made faithfully raises NotApplicable with the reason (shown in the report).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from posdiag.model.module_state import restore_state, saved_state
from posdiag.model.subject import Subject
from posdiag.tools import rope_math


class NotApplicable(Exception):
    """This alternative cannot be made on this model (the message says why)."""


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "Rotary" in type(m).__name__
            and any(n.endswith("inv_freq") for n in m._buffers)]


@contextlib.contextmanager
def rotary_rebuilt(subject: Subject, params: dict[str, Any], partial: float | None = None) -> Iterator[None]:
    """Every rotary module rebuilt from its config with `params` as rope_parameters (and `partial` as the
    config's partial_rotary_factor when given), restored on exit."""
    modules = rotary_modules(subject.language_model)
    if not modules:
        raise NotApplicable("no rotary module with inv_freq buffers found")
    rebuilt = [_rebuild(m, params, partial) for m in modules]
    if all(_same_buffers(m, r) for m, r in zip(modules, rebuilt, strict=True)):
        raise NotApplicable("the rotary module's frequencies do not change with this parameter")
    saved = [saved_state(m) for m in modules]
    dims = _rotary_dim_attributes(subject, partial)
    try:
        for owner, name, value in dims:
            setattr(owner, name, value)
        for module, new in zip(modules, rebuilt, strict=True):
            state = saved_state(new)
            module.__dict__.update(state.attributes)
            for name, value in state.buffers.items():
                old = module._buffers.get(name)
                module._buffers[name] = value if old is None or value is None else value.to(old.device)
        yield
    finally:
        for owner, name, _value in dims:
            setattr(owner, name, getattr(owner, f"_fit_saved_{name}"))
            delattr(owner, f"_fit_saved_{name}")
        for module, state in zip(modules, saved, strict=True):
            restore_state(module, state)


ROTARY_DIM_ATTRIBUTES = ("rotary_ndims", "rotary_dim", "rotary_emb_dim")  # attention modules that slice q/k themselves


def _rotary_dim_attributes(subject: Subject, partial: float | None) -> list[tuple[torch.nn.Module, str, int]]:
    """With partial rotary made full, the attention modules that keep their own rotary width (Phi's rotary_ndims,
    read from the config at init) get the full head width too; each old value is saved on the module."""
    if partial is None:
        return []
    out = []
    for module in subject.language_model.modules():
        head_dim = getattr(module, "head_dim", None)
        for name in ROTARY_DIM_ATTRIBUTES:
            value = module.__dict__.get(name)
            if isinstance(value, int) and isinstance(head_dim, int) and value < head_dim:
                module.__dict__[f"_fit_saved_{name}"] = value
                out.append((module, name, int(head_dim * partial)))
    return out


def _rebuild(module: torch.nn.Module, params: dict[str, Any], partial: float | None) -> torch.nn.Module:
    config = getattr(module, "config", None)
    if config is None:
        raise NotApplicable(f"{type(module).__name__} keeps no config to rebuild it from")
    config = copy.deepcopy(config)
    target = rope_math.text_config(config)
    target.rope_parameters = copy.deepcopy(params)
    if partial is not None and hasattr(target, "partial_rotary_factor"):
        target.partial_rotary_factor = partial
    device = next((b.device for b in module._buffers.values() if b is not None), torch.device("cpu"))
    try:
        try:
            new = type(module)(config=config, device=device)
        except TypeError:
            new = type(module)(config=config)
    except Exception as exc:
        raise NotApplicable(f"{type(module).__name__} cannot be built from the changed config "
                            f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return new


def _same_buffers(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    for name, value in a._buffers.items():
        other = b._buffers.get(name)
        if value is None or other is None:
            continue
        if value.shape != other.shape or not torch.equal(value.cpu(), other.cpu()):
            return False
    return True


# --------------------------------------------------------------------------- q/k pairing layout
def deinterleave(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order that takes weights in interleaved pairing order (pair i = dims 2i, 2i+1) to the half-split order
    rotate_half expects (pair i = dims i, i + r/2): new[i] = old[2i], new[r/2 + i] = old[2i + 1]."""
    rot = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)])
    return torch.cat([rot, torch.arange(rotary_dim, head_dim)])


def interleave(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The inverse: half-split weights into the interleaved order an interleaved rotation expects."""
    return torch.argsort(deinterleave(head_dim, rotary_dim))


def qk_projections(subject: Subject) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """(attention module, [q_proj, k_proj, per-head q/k norms]) for every attention with separate q/k maps.
    Raises NotApplicable where a projection is fused or a norm cannot be permuted along with it."""
    found = []
    for module in subject.language_model.modules():
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if not (isinstance(q, torch.nn.Linear) and isinstance(k, torch.nn.Linear)):
            continue
        norms = [getattr(module, n) for n in ("q_norm", "k_norm") if isinstance(getattr(module, n, None),
                                                                                  torch.nn.Module)]
        others = [n for n, m in module.named_children() if "norm" in n.lower() and m not in norms]
        if others:
            raise NotApplicable(f"{type(module).__name__} normalises q/k with {', '.join(others)}")
        found.append((module, [q, k, *norms]))
    if not found:
        raise NotApplicable("no attention with separate q_proj/k_proj linear maps (fused or absent)")
    return found


@contextlib.contextmanager
def qk_permuted(subject: Subject, order: torch.Tensor) -> Iterator[None]:
    """q_proj/k_proj rows (biases, q/k norm weights) of every head gathered by `order` [head_dim], undone on exit."""
    head_dim = int(order.numel())
    tensors = []
    for _attention, parts in qk_projections(subject):
        for part in parts:
            for name in ("weight", "bias"):
                t = getattr(part, name, None)
                if isinstance(t, torch.Tensor) and t.ndim >= 1:
                    if t.shape[0] % head_dim:
                        raise NotApplicable(f"{name} of {type(part).__name__} has {t.shape[0]} rows, not a multiple "
                                            f"of head_dim {head_dim}")
                    tensors.append(t)
    forward = _rows(order, tensors[0].device)
    backward = torch.argsort(forward)
    done = []
    try:
        with torch.no_grad():
            for t in tensors:
                _gather_rows(t, forward, head_dim)
                done.append(t)
        yield
    finally:
        with torch.no_grad():
            for t in done:
                _gather_rows(t, backward, head_dim)


def _rows(order: torch.Tensor, device: torch.device) -> torch.Tensor:
    return order.to(device=device, dtype=torch.long)


def _gather_rows(t: torch.Tensor, order: torch.Tensor, head_dim: int) -> None:
    """In place: each head's head_dim rows of t reordered by `order`."""
    shaped = t.data.view(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    shaped.copy_(shaped.index_select(1, order.to(t.device)))


# --------------------------------------------------------------------------- sliding window
@contextlib.contextmanager
def window_set(subject: Subject, window: int) -> Iterator[None]:
    """The sliding window made `window` tokens wherever the model reads it at forward time: `sliding_window` on every
    config object the model holds (the mask builders read it there) and on every module that keeps its own copy
    (attention modules pass it to the kernels); the old values go back on exit."""
    declared = subject.sliding_window  # None: a window the config leaves out, tried where it has the field
    owners = [o for o in _config_objects(subject) if hasattr(o, "sliding_window") and o.sliding_window == declared]
    owners += [m for m in subject.language_model.modules()
               if "sliding_window" in m.__dict__ and m.__dict__["sliding_window"] == declared]
    if not owners:
        raise NotApplicable(f"no config or module holds the declared window of {declared}")
    try:
        for owner in owners:
            owner.sliding_window = window
        yield
    finally:
        for owner in owners:
            owner.sliding_window = declared


def _config_objects(subject: Subject) -> list[Any]:
    found: list[Any] = []
    for cfg in (subject.config, getattr(subject.model, "config", None), getattr(subject.language_model, "config", None),
                rope_math.text_config(subject.config)):
        if cfg is not None and all(cfg is not f for f in found):
            found.append(cfg)
    return found
