"""Which positions to probe (one plan, or one on each side of a dynamic/longrope switch point), which
spec each layer follows, and putting stateful rotary modules back after probing them long."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from posdiag.checks.rope.capture import attention_modules
from posdiag.model.module_state import restore_state, saved_state
from posdiag.model.subject import Subject
from posdiag.tools import rope_math


@dataclass
class Plan:
    target: int                              # the length the static analysis is about
    declared: int | None                     # the context the config declares
    static: list[rope_math.SpecReport]       # frequencies vs training length, per spec
    layer_spec: list[rope_math.RopeSpec | None]  # the spec each layer follows (None: no rotation by design)
    probes: list[tuple[str, np.ndarray]]     # (label, positions) of each forward
    notes: list[str]


CONTIGUOUS_CAP = 4096  # tokens of one probe forward for a model that takes no position_ids


def make_plan(subject: Subject, settings: dict, specs: list[rope_math.RopeSpec]) -> Plan:
    """Positions spread over [0, max(target, declared context)], capped by a precomputed rotary table."""
    declared = subject.max_positions
    target = int(settings.get("target_length") or declared or max(s.training_length or 0 for s in specs) or 4096)
    static = [rope_math.report_spec(subject.config, s, target) for s in specs]
    layer_spec = _layer_specs(subject, specs)
    cap = _table_cap(subject.language_model)
    top = max(target, declared or 0, 2)
    notes: list[str] = []
    if cap is not None and top > cap:
        notes.append(f"positions capped at {cap - 1}: the rotary table has {cap} rows")
        top = cap
    probes = _plans(specs, top, cap)
    if not subject.family.takes_position_ids:
        # The model numbers its tokens itself (no position_ids reach it: MossTranscribeDiarize's wrapper drops them),
        # so a probe at positions p is a forward of p.max() + 1 tokens, read back at p.
        longest = min(int(max(p.max() for _, p in probes)) + 1, CONTIGUOUS_CAP)
        if longest < int(max(p.max() for _, p in probes)) + 1:
            notes.append(f"positions capped at {longest - 1}: the model takes no position_ids, so each probe is one "
                         f"contiguous forward")
        probes = [(label, np.arange(min(int(p.max()) + 1, longest))) for label, p in probes]
    return Plan(target, declared, static, layer_spec, probes, notes)


def _layer_specs(subject: Subject, specs: list[rope_math.RopeSpec]) -> list[rope_math.RopeSpec | None]:
    """The spec each layer follows; None where the config gives the layer no rotation (a layer type whose
    rope_parameters entry is None, as Beam's full-attention layers; a 0 in no_rope_layers or layer_rope_theta,
    as SmolLM3, Llama 4, Muse Glimmer)."""
    config = rope_math.text_config(subject.config)
    layers = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1)
    types = list(getattr(config, "layer_types", None) or [])
    if specs[0].layer_type is None:  # one rotary block for every layer
        out: list[rope_math.RopeSpec | None] = [specs[0]] * layers
    else:
        by_type = {s.layer_type: s for s in specs}
        params = rope_math.rope_parameters(config) or {}
        # Rope keys that are not layer types (DeepSeek-V4: "main" for sliding layers, "compress" for compressed ones):
        # each attention module names the one it reads.
        keys = [getattr(m, "rope_layer_type", None) for m in attention_modules(subject.language_model)]
        if keys and all(k in by_type for k in keys):
            out = [by_type[k] for k in keys]
        elif types:
            out = [None if t in params and params[t] is None else by_type.get(t, specs[0]) for t in types]
        else:
            out = [specs[0]] * layers
    nope = rope_math.nope_layers(config)  # no_rope_layers 0 (SmolLM3, Llama 4), layer_rope_theta 0 (Muse Glimmer)
    return [None if i in nope else spec for i, spec in enumerate(out)]


def _table_cap(model: torch.nn.Module) -> int | None:
    """Rotary modules with a precomputed position table (GPT-J) cannot be indexed past it."""
    for module in model.modules():
        table = getattr(module, "embed_positions", None)
        if "Rotary" in type(module).__name__ and isinstance(table, torch.Tensor):
            return int(table.shape[0])
    return None


def _plans(specs: list[rope_math.RopeSpec], top: int, cap: int | None) -> list[tuple[str, np.ndarray]]:
    switches = sorted({s.switch_length for s in specs if s.stateful and s.switch_length})
    marks = tuple(x for s in specs for L in (s.training_length,) if L for x in (L - 1, L, L + 1))
    if not switches:
        return [("all", _positions(top, marks))]
    switch = switches[0]
    long_top = max(top, 2 * switch)
    if cap is not None:
        long_top = min(long_top, cap)
    return [(f"below switch {switch}", _positions(switch, marks)),
            (f"beyond switch {switch}", _positions(long_top, marks + (switch - 1, switch, switch + 1)))]


def _positions(top: int, extra: tuple[int, ...] = ()) -> np.ndarray:
    """0..7, then ~40 geometric steps to top-1, plus the points in `extra` (all below top)."""
    last = max(top - 1, 1)
    pts = set(range(min(8, last + 1)))
    if last > 8:
        pts |= {int(round(x)) for x in np.geomspace(8, last, 40)}
    pts |= {e for e in extra if 0 <= e <= last}
    pts.add(last)
    return np.array(sorted(pts), dtype=np.int64)


@contextlib.contextmanager
def restored_rotary_state(model: torch.nn.Module):
    """Stateful rotary modules rewrite their buffers and attributes when probed long: put them back."""
    saved = [(module, saved_state(module, clone=True)) for module in model.modules()
             if any(n.endswith("inv_freq") for n in module._buffers) or hasattr(module, "rope_type")]
    try:
        yield
    finally:
        for module, state in saved:
            restore_state(module, state)
