"""The alternatives `fit` scores against the configuration as loaded: the mistakes a port or a config makes.

RoPE (from config.rope_parameters, one block per layer type where the config has several):
- base x {1/10, 1/4, 4, 10} (per layer type alone where there are several), and the layer types' bases swapped;
- a declared scaling block removed (rope_type default, same base);
- a partial rotary factor made full;
- the other pairing layout: the q/k rows permuted as a conversion between interleaved and half-split pairs would.
Learned / sinusoidal tables: the position ids offset by +-1, +-2 (RoBERTa-style padding_idx + 1 ports).
A declared sliding window (any position scheme): no window, half and double the window, where the material passes
the window (a window the material does not pass changes no score: not tried, and said so). No window declared, in a
config that has the field (Mistral's `sliding_window: null`): windows of 16, 64, 256... tokens, up to half the
material's rows, for a window a converter dropped.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.checks.fit.edits import (
    NotApplicable,
    deinterleave,
    interleave,
    qk_permuted,
    rotary_modules,
    rotary_rebuilt,
    window_set,
)
from posdiag.model.subject import Subject
from posdiag.tools import rope_math

THETA_FACTORS = (0.1, 0.25, 4.0, 10.0)
WINDOW_FACTORS = (0.5, 2.0)
UNDECLARED_WINDOW_FIRST, UNDECLARED_WINDOW_STEP = 16, 4  # windows tried where none is declared: 16, 64, 256...
TABLE_SHIFTS = (-2, -1, 1, 2)
SCALING_KEYS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                "short_factor", "long_factor", "low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim",
                "truncate", "short_mscale", "long_mscale")


@dataclass(frozen=True)
class Alternative:
    """label: short name for the table; fits: what the weights would fit (the FAIL sentence says "the weights fit
    <fits>, not <configured>"); configured: the loaded value it replaces; apply: fn(subject) -> context manager
    (the edit, restored on exit); shift: learned tables, added to the model's own position ids."""

    label: str
    fits: str
    configured: str
    apply: Callable[[Subject], Any] = lambda subject: contextlib.nullcontext()
    shift: int = 0
    factor: float = 0.0  # a rope_theta factor: where it sits on the line refine.py searches
    base: float = 0.0  # the configured rope_theta it multiplies
    scaled: Callable[[float], Alternative] | None = None  # the same alternative at another factor


def plan_alternatives(subject: Subject, length: int = 0) -> tuple[list[Alternative], list[str]]:
    """Every alternative for this model (scored on material of `length` tokens a row), and the notes on those that
    cannot apply."""
    alts, notes = _position_alternatives(subject)
    windows, why = window_alternatives(subject, length)
    return alts + windows, notes + ([why] if why else [])


def window_alternatives(subject: Subject, length: int) -> tuple[list[Alternative], str]:
    """No window, half and double the declared one: each changes which keys a row of `length` tokens sees (a value
    at or past the row's length is no window there; alternatives that would give the same mask are tried once)."""
    declared = subject.sliding_window
    if not declared:
        return _undeclared_windows(subject, length, "no sliding window (none declared)")
    if length <= declared:  # as good as no window on this material: a window too wide (32768 for 512) is a loss
        narrower, _ = _undeclared_windows(subject, length, f"the declared {declared}-token window, which the "
                                                           f"material's {length}-token rows never reach")
        return narrower, "" if narrower else (f"the sliding window not varied: the material's {length}-token rows do "
                                              f"not pass the declared {declared}-token window")
    alts, seen = [], {declared}
    for label, value in [("no window", length)] + [(f"window x{f:g}", max(1, int(declared * f)))
                                                  for f in WINDOW_FACTORS]:
        value = min(value, length)
        if value in seen:
            continue
        seen.add(value)
        fits = "no sliding window" if value >= length else f"a {value}-token sliding window"
        alts.append(Alternative(label, fits, f"the declared {declared}-token window",
                                lambda subject, v=value: window_set(subject, v)))
    return alts, ""


def _undeclared_windows(subject: Subject, length: int, configured: str) -> tuple[list[Alternative], str]:
    """Windows where the material sees none (none declared, or one wider than its rows) but the config has the
    field: a model trained with a window and converted without it (or with 32768 for its 512) sees every key, at
    distances it never learned (a real checkpoint: +4.37 nats a token past its window). Tried: 16, 64, 256... and
    the largest power of two up to half the rows. Not where the config turns windows off by another switch
    (`use_sliding_window: false`), which the mask builders read first."""
    configs = [c for c in (subject.config, rope_math.text_config(subject.config)) if c is not None]
    if not any(hasattr(c, "sliding_window") for c in configs) or \
            any(getattr(c, "use_sliding_window", True) is False for c in configs):
        return [], ""
    values = []
    value = UNDECLARED_WINDOW_FIRST
    while 2 * value <= length:
        values.append(value)
        value *= UNDECLARED_WINDOW_STEP
    widest = 1 << ((length // 2).bit_length() - 1) if length >= 2 * UNDECLARED_WINDOW_FIRST else 0
    if widest and widest not in values:
        values.append(widest)
    return [Alternative(f"window {v}", f"a {v}-token sliding window", configured,
                        lambda subject, v=v: window_set(subject, v)) for v in values], ""


def _position_alternatives(subject: Subject) -> tuple[list[Alternative], list[str]]:
    if subject.position_kind in ("learned", "sinusoidal"):
        if not subject.family.takes_position_ids:
            return [], [f"{subject.family.name} derives its positions inside: no offset can be passed"]
        return [Alternative(f"positions {k:+d}", f"position ids offset by {k:+d}", "the model's own position ids",
                            shift=k) for k in TABLE_SHIFTS], []
    if subject.position_kind != "rope":
        return [], []
    params = rope_math.rope_parameters(subject.config)
    specs = rope_math.rope_specs(subject.config)
    if not params or not specs:
        return [], ["the config gives no rope parameters"]
    alts = _rope_alternatives(params, specs)
    notes: list[str] = []
    layout, why = _layout_alternative(subject, specs)
    if layout is None:
        notes.append(f"pairing layout not tried: {why}")
    else:
        alts.append(layout)
    return alts, notes


def _rope_alternatives(params: dict[str, Any], specs: list[rope_math.RopeSpec]) -> list[Alternative]:
    per_type = specs[0].layer_type is not None
    alts = []
    for spec in specs:
        where = f" ({spec.layer_type})" if per_type else ""
        alts += [_theta_alt(params, spec, where, f) for f in THETA_FACTORS]
        if spec.rope_type != "default":
            block = {k: v for k, v in spec.params.items() if k not in SCALING_KEYS}
            block.update(rope_type="default", rope_theta=spec.theta)
            declared = f"the declared {spec.rope_type} scaling" + (f" (factor {spec.factor:g})" if spec.factor else "")
            alts.append(_params_alt(f"no scaling{where}", f"no rope scaling{where}", declared,
                                    _replaced(params, spec, block)))
        if spec.partial_rotary_factor < 1:
            alts.append(_params_alt(f"full rotary{where}", f"every dim rotating{where}",
                                    f"partial_rotary_factor {spec.partial_rotary_factor:g}",
                                    _edited(params, spec, partial_rotary_factor=1.0), partial=1.0))
    thetas = {s.layer_type: s.theta for s in specs}
    if per_type and len(specs) == 2 and len(set(thetas.values())) == 2:
        a, b = specs
        swapped = _edited(_edited(params, a, rope_theta=b.theta), b, rope_theta=a.theta)
        alts.append(_params_alt("bases swapped", f"{a.layer_type} base {b.theta:g} and {b.layer_type} base "
                                f"{a.theta:g}", f"the configured {a.theta:g} / {b.theta:g}", swapped))
    return alts


def _theta_alt(params: dict[str, Any], spec: rope_math.RopeSpec, where: str, factor: float) -> Alternative:
    theta = spec.theta * factor
    alt = _params_alt(f"rope_theta x{factor:.3g}{where}", f"rope_theta={theta:.6g}{where}",
                      f"the configured {spec.theta:g}", _edited(params, spec, rope_theta=theta))
    return dataclasses.replace(alt, factor=factor, base=spec.theta,
                               scaled=lambda f: _theta_alt(params, spec, where, f))


def _params_alt(label: str, fits: str, configured: str, params: dict[str, Any],
                partial: float | None = None) -> Alternative:
    return Alternative(label, fits, configured, lambda subject: rotary_rebuilt(subject, params, partial))


def _edited(params: dict[str, Any], spec: rope_math.RopeSpec, **changes: Any) -> dict[str, Any]:
    block = dict(params[spec.layer_type] if spec.layer_type else params)
    block.update(changes)
    return _replaced(params, spec, block)


def _replaced(params: dict[str, Any], spec: rope_math.RopeSpec, block: dict[str, Any]) -> dict[str, Any]:
    if spec.layer_type is None:
        return dict(block)
    out = copy.deepcopy(params)
    out[spec.layer_type] = dict(block)
    return out


def _layout_alternative(subject: Subject, specs: list[rope_math.RopeSpec]) -> tuple[Alternative | None, str]:
    """The q/k rows permuted into the other pairing layout than the one the model's cos table shows."""
    if len({(s.head_dim, s.rotary_dim) for s in specs}) > 1:
        return None, "layer types differ in head or rotary dims"
    spec = specs[0]
    if spec.rotary_dim % 2 or spec.rotary_dim < 4:
        return None, f"{spec.rotary_dim} rotary dims"
    layout = pairing_layout(subject)
    if layout == "half":
        order = deinterleave(spec.head_dim, spec.rotary_dim)
        return Alternative("q/k interleaved", "q/k rows in the interleaved pairing order",
                           "the half-split order the code rotates", lambda s: qk_permuted(s, order)), ""
    if layout == "interleaved":
        order = interleave(spec.head_dim, spec.rotary_dim)
        return Alternative("q/k half-split", "q/k rows in the half-split pairing order",
                           "the interleaved order the code rotates", lambda s: qk_permuted(s, order)), ""
    return None, "the rotary table's pairing layout could not be read"


def pairing_layout(subject: Subject) -> str | None:
    """"half" when the rotary module's cos repeats its first half (rotate_half), "interleaved" when it repeats
    each entry (pairs of adjacent dims), None when neither can be read."""
    modules = rotary_modules(subject.language_model)
    if not modules:
        return None
    module = modules[0]
    x = torch.zeros(1, 1, 8, dtype=subject.dtype, device=subject.device)
    pos = torch.arange(1, 9, device=subject.device)[None]
    types = sorted(set(getattr(subject.config, "layer_types", None) or [])) or [None]
    for kwargs in [{}] + [{"layer_type": t} for t in types if t]:
        try:
            with torch.inference_mode():
                out = module(x, pos, **kwargs)
        except Exception:
            continue
        cos = out[0] if isinstance(out, (tuple, list)) else None
        if not isinstance(cos, torch.Tensor) or cos.shape[-1] < 4:
            continue
        cos = cos.reshape(-1, cos.shape[-1]).double()
        half = cos.shape[-1] // 2
        if torch.equal(cos[:, :half], cos[:, half:2 * half]):
            return "half"
        if torch.equal(cos[:, 0::2], cos[:, 1::2]):
            return "interleaved"
    return None


__all__ = ["Alternative", "NotApplicable", "pairing_layout", "plan_alternatives"]
