"""RoPE as a config declares it: the specs (one per layer type), the layers without positions, and the frequencies
each spec gives, before and after its scaling.

The config is read the way transformers 5.x reads it (`config.rope_parameters`, possibly one dict per layer type),
and every scaled frequency set comes from transformers' own `ROPE_INIT_FUNCTIONS`; the unscaled ("default") set is
computed here in float64 (transformers keeps it in each model's rotary class). What the frequencies mean (turns,
the critical pair, aliasing, decay) is posdiag.tools.rope_math.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATEFUL_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary setup (one per layer type where the config gives several).

    layer_type:   the key in config.rope_parameters (None when one dict serves every layer).
    rope_type:    default | linear | dynamic | yarn | longrope | llama3 | proportional | ...
    theta:        the base.
    head_dim / rotary_dim: dims per head / dims that rotate (head_dim x partial_rotary_factor).
    factor:       the scaling factor when the block gives one.
    original_max: original_max_position_embeddings when the block (or config) gives one.
    declared:     max_position_embeddings (the declared context).
    params:       the raw parameter block, for the report.
    """

    layer_type: str | None
    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max: int | None = None
    declared: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def training_length(self) -> int | None:
        """L: the original length when the config records one, else the declared context."""
        return self.original_max or self.declared

    @property
    def stateful(self) -> bool:
        """dynamic / longrope modules change their frequencies with the sequence length."""
        return "dynamic" in self.rope_type or self.rope_type == "longrope"

    @property
    def switch_length(self) -> int | None:
        """The length at which a stateful type switches (dynamic: the declared context; longrope: the original)."""
        if "dynamic" in self.rope_type:
            return self.declared
        if self.rope_type == "longrope":
            return self.original_max or self.declared
        return None

    @property
    def claimed_length(self) -> int | None:
        """The longest context the config claims: the declared context, or factor x original for a scaling block."""
        claims = [v for v in (self.declared,) if v]
        if self.factor and self.original_max and self.rope_type != "default":
            claims.append(int(self.factor * self.original_max))
        return max(claims) if claims else None

    @property
    def label(self) -> str:
        return self.layer_type or "all layers"


# --------------------------------------------------------------------------- reading the config
def text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except Exception:  # pragma: no cover - odd configs
        return config


def layer_config(config: Any, layer: int | str | None) -> Any:
    """The config one layer (an index) or one layer type (a name in layer_types) is built from: transformers 5.x
    heterogeneous configs (Gemma4: full-attention layers with their own head_dim) keep per-layer attributes in
    `config.per_layer_config` and raise when they are read off the global config (its rotary classes read them so)."""
    config = text_config(config)
    if layer is None or not getattr(config, "is_heterogeneous", False):
        return config
    try:
        return config.per_layer_config[layer]
    except (ValueError, IndexError, KeyError, TypeError):  # a layer type whose layers differ: its first layer
        types = list(getattr(config, "layer_types", None) or [])
        return config.per_layer_config[types.index(layer)] if layer in types else config


def head_dim_of(config: Any) -> int | None:
    if getattr(config, "is_heterogeneous", False):
        config = layer_config(config, 0)  # one value for the whole model: read it from layer 0
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    return int(hidden // heads) if hidden and heads else None


def declared_context(config: Any) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def rope_parameters(config: Any) -> dict[str, Any] | None:
    """config.rope_parameters as transformers 5.x standardises it (None when the config has none)."""
    config = text_config(config)
    standardize = getattr(config, "standardize_rope_params", None)
    if callable(standardize):
        with contextlib.suppress(Exception):
            standardize()
    params = getattr(config, "rope_parameters", None)
    return dict(params) if isinstance(params, dict) and params else None


def rope_specs(config: Any) -> list[RopeSpec]:
    """Every rotary setup in the config; [] when the config describes no RoPE."""
    config = text_config(config)
    declared = declared_context(config)
    params = rope_parameters(config)
    head_dim = head_dim_of(config)
    if params is None:
        rotary_dim = getattr(config, "rotary_dim", None)  # GPT-J: a fixed base of 10000 in the model code
        if rotary_dim and head_dim:
            return [RopeSpec(None, "default", 10000.0, head_dim, int(rotary_dim), rotary_dim / head_dim,
                             declared=declared, params={"rotary_dim": rotary_dim})]
        return []
    if head_dim is None:
        return []
    # one dict per layer type; None for a type that runs without RoPE (Beam's full-attention layers)
    if all(isinstance(v, dict) or v is None for v in params.values()) and any(params.values()):
        blocks = sorted(((k, v) for k, v in params.items() if v), key=lambda kv: _first_use(config, kv[0]))
    else:
        blocks = [(None, params)]
    specs = []
    for layer_type, block in blocks:
        layer = layer_config(config, layer_type)  # each layer type its own head_dim (Gemma4)
        head_dim = head_dim_of(layer) or head_dim
        partial = float(block.get("partial_rotary_factor", getattr(layer, "partial_rotary_factor", 1.0)) or 1.0)
        rope_type = str(block.get("rope_type", block.get("type", "default")))
        original = (block.get("original_max_position_embeddings")
                    or getattr(layer, "original_max_position_embeddings", None))
        factor = block.get("factor")
        specs.append(RopeSpec(
            layer_type=layer_type, rope_type=rope_type, theta=float(block.get("rope_theta", 10000.0)),
            head_dim=head_dim, rotary_dim=int(head_dim * partial), partial_rotary_factor=partial,
            factor=float(factor) if factor is not None else None,
            original_max=int(original) if original else None, declared=declared, params=dict(block),
        ))
    return specs


def _first_use(config: Any, layer_type: str) -> tuple[int, str]:
    """Where a layer type first appears in `config.layer_types` (then its name): reports list the rotary setups
    in a stable order. Some configs build `rope_parameters` from a set of layer types, whose order changes with
    every process's string hashing."""
    types = list(getattr(config, "layer_types", None) or [])
    return (types.index(layer_type) if layer_type in types else len(types), str(layer_type))


def nope_layers(config: Any) -> set[int]:
    """Layers the config runs without any rotation (NoPE): `no_rope_layers` entries 0 (SmolLM3, Llama 4:
    1 = RoPE), `layer_rope_theta` entries 0 (Muse Glimmer, Granite-SWA: a base per layer, 0 = NoPE)."""
    config = text_config(config)
    for field_name in ("no_rope_layers", "layer_rope_theta"):
        values = getattr(config, field_name, None)
        if isinstance(values, (list, tuple)) and all(isinstance(v, (int, float)) for v in values):
            return {i for i, v in enumerate(values) if not v}
    return set()


# --------------------------------------------------------------------------- frequencies
def default_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """θ_i = theta^(-2i/d) in float64, i = 0 .. d/2-1 (NaN for a non-positive theta, as the model gets)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def inv_freq(config: Any, spec: RopeSpec, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(θ_i, attention_scaling) for `spec` at sequence length `seq_len` (stateful types depend on it).

    Scaled types come from transformers' ROPE_INIT_FUNCTIONS (their float32 values, as the model's
    buffers hold them); the default set is computed in float64.
    """
    if spec.rope_type == "default":
        return default_inv_freq(spec.theta, spec.rotary_dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS.get(spec.rope_type)
    if fn is None:
        raise ValueError(f"rope_type '{spec.rope_type}' is unknown to this transformers version "
                         f"(known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    freqs, scaling = fn(layer_config(config, spec.layer_type), "cpu", seq_len=seq_len, layer_type=spec.layer_type)
    return freqs.detach().to("cpu").double().numpy(), float(scaling)


def unscaled_inv_freq(spec: RopeSpec) -> np.ndarray:
    """The frequencies before scaling: the default set with the same base and rotary dims."""
    return default_inv_freq(spec.theta, spec.rotary_dim)


# --------------------------------------------------------------------------- analysis
