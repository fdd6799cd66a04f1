"""Token mixing that reads the storage order of a config's tokens besides attention (rows without a family row).

Such a mixer makes a consistent permutation no identity: `Family.token_mixing` names it in reports.
"""

from __future__ import annotations

from typing import Any


def storage_order_mixing(config: Any) -> str:
    """What mixes the tokens in storage order for this config ("" when nothing does besides attention)."""
    return _capacity_routing(config) or _compressed_pooling(config) or _hashed_ngrams(config)


def _hashed_ngrams(config: Any) -> str:
    """BLT adds to each byte's embedding hash embeddings of the n bytes ending at it (encoder_hash_byte_group_size:
    3 to 8), taken in storage order: a consistent permutation feeds every byte other n-grams, so it is no identity."""
    sizes = getattr(config, "encoder_hash_byte_group_size", None)
    if not isinstance(sizes, (list, tuple)) or not sizes:
        return ""
    return f"hash embeddings of the {', '.join(map(str, sizes))} bytes ending at each byte, in storage order"


def _capacity_routing(config: Any) -> str:
    """Experts with a capacity filled in storage order (Switch Transformers, NLLB-MoE: a cumulative count along the
    sequence; past `expert_capacity` a token skips its expert), so a token's output depends on the tokens before it.
    Measured on the tiny Switch model (capacity 64): `shift`'s prefix of 64 invisible padding tokens moved the decoder's
    outputs 0.149 (the prefix filled the experts), while 48 kept them within rounding."""
    capacity = getattr(config, "expert_capacity", None)
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        return ""
    return f"experts with a capacity of {capacity} tokens each, filled in storage order (expert_capacity)"


def _compressed_pooling(config: Any) -> str:
    """DeepSeek-V4's compressed layers pool each `compress_rate` consecutive keys (storage order, a per-slot bias) into
    one entry: a consistent permutation is no identity (tiny model, rate 4: 0.167 off P f(x), the same in float64)."""
    rates = getattr(config, "compress_rates", None)
    used = sorted({k for k in getattr(config, "layer_types", None) or () if isinstance(rates, dict) and k in rates})
    if not used:
        return ""
    named = ", ".join(f"{kind} {rates[kind]}" for kind in used)
    return f"compressed attention pooling consecutive keys in storage order (compress_rates: {named})"


def storage_positions(config: Any) -> str:
    """How a config reads absolute positions from storage order besides position_ids ("" when it does not)."""
    pooling = _compressed_pooling(config)
    if not pooling:
        return ""
    return ("compressed keys are rotated at their window's storage position (i * compress_rate past the cache's "
            "count), not at position_ids: shifting position_ids moves the queries only")
