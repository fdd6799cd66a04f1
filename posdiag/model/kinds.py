"""What kind of model a config describes: the `Kind` and `PositionKind` members the quirk table and reports use,
and the sniffing that gives a model type without a row its kind."""

from __future__ import annotations

import enum
from typing import Any


class _Named(str, enum.Enum):
    """A str-valued member: equal to its string, written as it in JSON, reports and f-strings."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Kind(_Named):
    """Which stacks a model has and how they attend."""

    CAUSAL = "causal"
    ENCODER = "encoder"
    SEQ2SEQ = "seq2seq"


class PositionKind(_Named):
    """How positions enter. NONE: no row says, and `detect_position_kind` found no mechanism by name."""

    ROPE = "rope"
    LEARNED = "learned"
    SINUSOIDAL = "sinusoidal"
    ALIBI = "alibi"
    RELATIVE_BIAS = "relative_bias"
    NONE = "none found"


def declared_causal(config: Any) -> bool:
    """The checkpoint says it decodes: is_decoder=True or a causal-LM head among its architectures."""
    archs = getattr(config, "architectures", None) or []
    return bool(getattr(config, "is_decoder", False)) or any(a.endswith(_CAUSAL_HEADS) for a in archs)


_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def masked_only(model_type: str | None) -> bool:
    """A type transformers builds as a masked LM and never as a causal LM."""
    from transformers.models.auto import modeling_auto as auto

    return (model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def guess_kind(config: Any) -> Kind:
    """The kind of a config whose type has no row: read off its flags and heads."""
    if getattr(config, "is_encoder_decoder", False):
        return Kind.SEQ2SEQ
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(_CAUSAL_HEADS) for a in archs):
        return Kind.CAUSAL
    if any(a.endswith(("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification")) for a in archs):
        return Kind.ENCODER
    if getattr(config, "is_decoder", None) is None and masked_only(getattr(config, "model_type", None)):
        # A config with no is_decoder field (5.x dropped it from many) of a type transformers builds only as a
        # masked LM is a bidirectional encoder: guessed causal, ALBERT read as leaking the future (a false FAIL).
        return Kind.ENCODER
    return Kind.CAUSAL if getattr(config, "is_decoder", True) else Kind.ENCODER
