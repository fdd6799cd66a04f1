"""The alternatives `fit` scores against the configuration as loaded: the mistakes a port or a config makes.

RoPE (from config.rope_parameters, one block per layer type where the config has several):
- base x {1/10, 1/4, 4, 10} (per layer type alone where there are several), and the layer types' bases swapped;
- a declared scaling block removed (rope_type default, same base);
- a partial rotary factor made full;
- the other pairing layout: the q/k rows permuted as a conversion between interleaved and half-split pairs would.
Learned / sinusoidal tables: the position ids offset by +-1, +-2 (RoBERTa-style padding_idx + 1 ports).
"""

from __future__ import annotations

import contextlib
import copy
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
)
from posdiag.model.subject import Subject
from posdiag.tools import rope_math

THETA_FACTORS = (0.1, 0.25, 4.0, 10.0)
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


def plan_alternatives(subject: Subject) -> tuple[list[Alternative], list[str]]:
    """Every alternative for this model, and the notes on those that cannot apply."""
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
        for f in THETA_FACTORS:
            theta = spec.theta * f
            alts.append(_params_alt(f"rope_theta x{f:g}{where}", f"rope_theta={theta:g}{where}",
                                    f"the configured {spec.theta:g}", _edited(params, spec, rope_theta=theta)))
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
