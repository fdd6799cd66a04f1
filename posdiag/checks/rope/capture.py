"""Observing q/k where attention consumes them: the eager attention function and apply_rotary_pos_emb
are wrapped in every attention module's globals, q_proj/k_proj hooked for the un-rotated q/k."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import numpy as np
import torch

from posdiag.model.subject import Subject

APPLY_SOURCE = "apply_rotary_pos_emb inputs"  # the un-rotated q/k handed to the apply function, its output beside


class Capture:
    """Record q/k as attention consumes them (eager function) or as the apply function returns them,
    each with the un-rotated q/k of the same call when one is observable (for the attention factor)."""

    def __init__(self, eager: bool):
        self.eager_mode = eager  # the model runs the eager attention function (it sees what attention consumes)
        # (module, q, k, [(q0, k0, source, q1, k1)]): q0/k0 un-rotated, q1/k1 the same call's rotated
        # output (None: the q/k attention consumed). Pairing the apply function's own input and output
        # keeps whatever runs between rotation and attention (HunYuan's q/k norm) out of the factor.
        self.records: list[tuple[Any, torch.Tensor, torch.Tensor, list[tuple]]] = []
        self.pending: tuple[torch.Tensor, ...] | None = None  # inputs and outputs of the last apply call
        self.projected: dict[int, dict[str, torch.Tensor]] = {}  # id(attention) -> q_proj/k_proj outputs
        self.rotated: list[bool] = []  # per record: apply_rotary_pos_emb ran since the previous attention call
        self.applied = False

    def eager(self, original):
        def wrapped(module, query, key, value, *args, **kwargs):
            plain = [] if self.pending is None else [(*self.pending[:2], APPLY_SOURCE,
                                                      *self.pending[2:])]
            self.pending = None
            proj = self.projected.pop(id(module), {})
            if {"q", "k"} <= set(proj):
                plain.append((proj["q"], proj["k"], "q_proj/k_proj outputs", None, None))
            self.records.append((module, query.detach().clone(), key.detach().clone(), plain))
            self.rotated.append(self.applied)
            self.applied = False
            return original(module, query, key, value, *args, **kwargs)
        return wrapped

    def apply(self, original, record: bool):
        """record: the rotated q/k are captured here (no eager function to see them); else only the inputs."""
        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            self.applied = True
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                return out
            q_in = args[0] if len(args) > 0 else kwargs.get("q")
            k_in = args[1] if len(args) > 1 else kwargs.get("k")
            plain = None
            if all(isinstance(t, torch.Tensor) and t.shape == o.shape for t, o in zip((q_in, k_in), out, strict=True)):
                plain = (q_in.detach().clone(), k_in.detach().clone())
            if not record:
                self.pending = None if plain is None else (*plain, out[0].detach().clone(), out[1].detach().clone())
            else:
                self.records.append((None, out[0].detach().clone(), out[1].detach().clone(),
                                     [(*plain, APPLY_SOURCE, None, None)] if plain else []))
                self.rotated.append(True)
            return out
        return wrapped

    def first_calls(self) -> None:
        """Keep one record per attention module, its first call: a looped model (Dory) runs its recurrent layers
        several times per forward, so the n-th call is not layer n (a later call was judged against the next
        layer's frequencies, and FAILed)."""
        if any(module is None for module, *_ in self.records):
            return
        seen: set[int] = set()
        keep = [i for i, (module, *_) in enumerate(self.records) if not (id(module) in seen or seen.add(id(module)))]
        if len(keep) < len(self.records):
            if len(self.rotated) == len(self.records):
                self.rotated[:] = [self.rotated[i] for i in keep]
            self.records[:] = [self.records[i] for i in keep]

    def layer_indices(self, layers: int) -> list[int]:
        """The decoder layer of each record. Attention calls are the layers on a pure attention model; a hybrid calls
        attention in some layers only (Qwen3-Next every fourth), so its records are numbered by the modules'
        layer_idx when every module has a distinct one."""
        order = list(range(len(self.records)))
        if len(self.records) >= layers:
            return order
        idx = [getattr(module, "layer_idx", None) for module, *_ in self.records]
        if all(isinstance(i, int) and 0 <= i < layers for i in idx) and len(set(idx)) == len(idx):
            return idx
        return order

    def projection(self, attention: torch.nn.Module, name: str):
        def hook(_module, _inputs, output):
            if isinstance(output, torch.Tensor):
                self.projected.setdefault(id(attention), {})[name] = output.detach().clone()
        return hook


def without_rope(subject: Subject, layer_spec: list, capture: Capture,
                 layers: list[int] | None = None) -> dict[int, str]:
    """Layers that run without RoPE by design -> why: the config gives their layer no rotary block (Beam's
    rope_parameters["full_attention"] is None, SmolLM3's no_rope_layers), or, seen in the run, no rotation is
    applied before attention at any layer of one layer type while layers of another type rotate (Cohere2 and
    Flint rotate only their sliding-window layers). An unrotated layer of a type that rotates elsewhere has no
    such reason: it is judged (and fails). layers: the decoder layer of each record where a hybrid calls attention
    in some layers only (Capture.layer_indices); a layer type without attention calls (recurrent mixers) is no such
    type."""
    config = getattr(subject.config, "text_config", None) or subject.config
    types = list(getattr(config, "layer_types", None) or [])
    nope = "the config marks it NoPE (no_rope_layers or layer_rope_theta)"
    out = {i: (f"the config gives '{types[i]}' layers no rotary block" if len(types) == len(layer_spec) else nope)
           for i, spec in enumerate(layer_spec) if spec is None}
    if layers is None:
        layers = list(range(len(types))) if len(capture.records) == len(types) else []
    if (len(capture.rotated) != len(capture.records) or len(layers) != len(capture.records)
            or not all(i < len(types) for i in layers) or not any(capture.rotated)):
        return out
    rotated = dict(zip(layers, capture.rotated, strict=True))
    for kind in dict.fromkeys(types):
        of_kind = [i for i in rotated if types[i] == kind]
        if of_kind and not any(rotated[i] for i in of_kind):
            out.update({i: out.get(i, f"no rotation is applied at any '{kind}' layer while the other layer types "
                                      "rotate") for i in of_kind})
    return out


@contextlib.contextmanager
def capturing(subject: Subject, capture: Capture):
    """Wrap eager attention (eager runs) and apply_rotary_pos_emb in every attention module's globals."""
    patched, hooks = [], []
    for g in _attention_globals(subject.language_model):
        eager = capture.eager_mode and callable(g.get("eager_attention_forward"))
        if eager:
            patched.append((g, "eager_attention_forward", g["eager_attention_forward"]))
            g["eager_attention_forward"] = capture.eager(g["eager_attention_forward"])
        if callable(g.get("apply_rotary_pos_emb")):
            patched.append((g, "apply_rotary_pos_emb", g["apply_rotary_pos_emb"]))
            g["apply_rotary_pos_emb"] = capture.apply(g["apply_rotary_pos_emb"], record=not eager)
    if capture.eager_mode:
        for attention in attention_modules(subject.language_model):
            for name, proj in plain_projections(attention).items():
                hooks.append(proj.register_forward_hook(capture.projection(attention, name)))
    try:
        yield bool(patched)
    finally:
        for h in hooks:
            h.remove()
        for g, name, original in reversed(patched):
            g[name] = original


def _attention_globals(model: torch.nn.Module) -> list[dict]:
    seen, out = set(), []
    for module in attention_modules(model):
        fn = module.__dict__.get("forward") or type(module).forward
        fn = getattr(fn, "__func__", fn)
        g = inspect.unwrap(fn).__globals__
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if type(m).__name__.endswith(("Attention", "SelfAttention")) and "Rotary" not in type(m).__name__]


def plain_projections(attention: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """q_proj/k_proj whose outputs are the un-rotated q/k: separate linear maps, no norm module after them."""
    if any("norm" in type(m).__name__.lower() for m in attention.modules()):
        return {}
    proj = {n: getattr(attention, f"{n}_proj", None) for n in ("q", "k")}
    return proj if all(isinstance(m, torch.nn.Linear) for m in proj.values()) else {}


def heads(t: torch.Tensor, n: int) -> np.ndarray | None:
    """[B, H, T, D] (or [B, T, H, D]) -> float64 [H, T, D] of row 0."""
    if t.ndim != 4:
        return None
    if t.shape[2] == n:
        x = t[0]
    elif t.shape[1] == n:
        x = t[0].transpose(0, 1)
    else:
        return None
    return x.double().cpu().numpy()
