"""Token mixing that reads the storage order of a config's tokens besides attention (rows without a family row).

Such a mixer makes a consistent permutation no identity: `Family.token_mixing` names it in reports.
"""

from __future__ import annotations

from typing import Any


def storage_order_mixing(config: Any) -> str:
    """What mixes the tokens in storage order for this config ("" when nothing does besides attention)."""
    return _capacity_routing(config) or _compressed_pooling(config) or _hashed_ngrams(config) \
        or length_dependent_pooling(config)


def length_dependent_pooling(config: Any) -> str:
    """Pooling between blocks whose windows follow the stored length, padding included ("" when none). Funnel mean-pools
    pairs of stored positions between its blocks, the mask only pooled beside them, and by default (separate_cls,
    truncate_seq) drops the last stored position first: a padding column in a padded batch, the row's last token
    alone. On the tiny model a right-padded row differs from itself alone by 0.216 (relative, float64; 0.195 without
    truncation, where an odd pooled length pairs a valid window with a padding one); with one block, by 0."""
    blocks = getattr(config, "block_sizes", None)
    if not isinstance(blocks, (list, tuple)) or len(blocks) < 2:
        return ""
    return ("mean pooling of consecutive stored positions between its blocks (block_sizes), padding included"
            + (", after dropping the last stored position (separate_cls, truncate_seq)"
               if getattr(config, "separate_cls", False) and getattr(config, "truncate_seq", False) else ""))


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
