"""Per-architecture quirks, in one table.

Every row says what breaks without it and how that was measured (transformers 5.24,
torch 2.13, CPU, tiny configs from `posdiag.zoo`, eager attention). Checks never test a
family name themselves: they read a `Family` and its fields.

Unknown model types get `GENERIC`, whose fields are the safe defaults: positions and masks
are *measured* (mask fidelity, position_ids effect) before any verdict relies on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Family:
    """How to drive one architecture faithfully.

    kind:             causal | encoder | seq2seq (which stacks exist and how they attend).
    position_kind:    rope | learned | sinusoidal | alibi | relative_bias | none found.
    mask_form:        how an explicit attention pattern is handed over:
                      "4d"          one additive float [B,1,T,T] mask (window written in, if any);
                      "layer_dict"  {"full_attention": m, "sliding_attention": m_w} by layer type;
                      "none"        the family cannot take an explicit pattern (reason in mask_note).
    position_ids:     "honoured" (passed and used), "ignored" (accepted via **kwargs and dropped:
                      positions derived inside), or "required" (must be passed with a 4D mask).
    position_offset:  index of the first position row in the learned table (OPT 2, RoBERTa pad+1).
    open_buffers:     bool buffers ANDed into the scores that an explicit mask cannot open; set to
                      all-True while an explicit pattern is in use, restored after.
    eager_only:       the family refuses attn_implementation="sdpa" in transformers 5.x.
    mask_note:        why mask_form is "none" (shown in skips).
    """

    name: str
    kind: str = "causal"
    position_kind: str = "none found"
    mask_form: str = "4d"
    position_ids: str = "honoured"
    position_offset: int = 0
    open_buffers: tuple[str, ...] = ()
    eager_only: bool = False
    mask_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def takes_position_ids(self) -> bool:
        return self.position_ids in ("honoured", "required")


GENERIC = Family(name="generic")

_ROWS: dict[str, Family] = {
    # --- RoPE decoders: 4D additive masks are used as-is; position_ids honoured. ---------------
    "llama": Family("llama", position_kind="rope"),
    "qwen3": Family("qwen3", position_kind="rope"),
    "gemma": Family("gemma", position_kind="rope"),
    "phi": Family("phi", position_kind="rope"),  # partial rotary
    "phi3": Family("phi3", position_kind="rope"),
    "gpt_neox": Family("gpt_neox", position_kind="rope"),
    "gptj": Family("gptj", position_kind="rope"),  # interleaved pairs
    "stablelm": Family("stablelm", position_kind="rope"),
    "olmo2": Family("olmo2", position_kind="rope"),
    "cohere": Family("cohere", position_kind="rope"),  # interleaved pairs
    # Sliding window in one uniform size: a single 4D mask replaces the model's and drops the
    # window unless it is written into the mask (explicit != default once T > window).
    "mistral": Family("mistral", position_kind="rope"),
    # Hybrid/sliding layers: one 4D mask would replace every layer's mask; these accept a dict
    # keyed by config.layer_types so each layer keeps its own pattern.
    "qwen2": Family("qwen2", position_kind="rope", mask_form="layer_dict"),
    "gemma2": Family("gemma2", position_kind="rope", mask_form="layer_dict", eager_only=True),
    "gemma3_text": Family("gemma3_text", position_kind="rope", mask_form="layer_dict"),
    "falcon": Family("falcon", position_kind="rope"),  # alibi variant chosen in family_for()
    # --- Learned absolute tables ------------------------------------------------------------
    "gpt2": Family("gpt2", position_kind="learned"),
    # GPT-Neo ANDs a hard-coded causal `bias` buffer into every layer: a permuted mask cannot
    # open a future key until the buffer is opened (measured: "open" probe unchanged).
    "gpt_neo": Family("gpt_neo", position_kind="learned", open_buffers=("attn.attention.bias",), eager_only=True),
    # OPT derives positions from the 2D mask cumsum (+2); with a 4D mask it needs explicit ids.
    "opt": Family("opt", position_kind="learned", position_ids="required", position_offset=2),
    # --- ALiBi: bias built from a 2D padding mask; a 4D mask crashes (Bloom) or reads inverted
    #     (MPT). Positions come from the mask, so position_ids are not accepted. -----------
    "bloom": Family("bloom", position_kind="alibi", mask_form="none", position_ids="ignored", eager_only=True,
                    mask_note="Bloom builds its ALiBi bias from a 2D padding mask and rejects a 4D mask"),
    "mpt": Family("mpt", position_kind="alibi", mask_form="none", position_ids="ignored", eager_only=True,
                  mask_note="MPT reads explicit masks inverted and its ALiBi bias ignores them"),
    # --- Encoders: bidirectional; the permutation needs no mask at all. -----------------------
    "bert": Family("bert", kind="encoder", position_kind="learned"),
    "roberta": Family("roberta", kind="encoder", position_kind="learned", extra={"offset_from": "pad_token_id+1"}),
    "distilbert": Family("distilbert", kind="encoder", position_kind="learned"),
    "modernbert": Family("modernbert", kind="encoder", position_kind="rope"),
    # --- Encoder-decoders: the 4D pattern goes to decoder_attention_mask (a top-level mask would
    #     be reused as the cross-attention mask). Positions are derived inside. -----------------
    "t5": Family("t5", kind="seq2seq", position_kind="relative_bias", position_ids="ignored"),
    "bart": Family("bart", kind="seq2seq", position_kind="learned", position_ids="ignored", position_offset=2),
    "marian": Family("marian", kind="seq2seq", position_kind="sinusoidal", position_ids="ignored"),
}


def family_for(config: Any) -> Family:
    """The quirk row for a loaded config (some rows depend on config fields)."""
    model_type = getattr(config, "model_type", None) or "generic"
    row = _ROWS.get(model_type)
    if row is None:
        return replace(GENERIC, name=model_type, kind=_guess_kind(config))
    if model_type == "falcon" and getattr(config, "alibi", False):
        # Falcon-alibi builds the bias from the 2D mask like Bloom.
        return replace(row, position_kind="alibi", mask_form="none", position_ids="ignored",
                       mask_note="Falcon-alibi builds its bias from a 2D padding mask")
    if model_type == "distilbert" and getattr(config, "sinusoidal_pos_embds", False):
        return replace(row, position_kind="sinusoidal")
    return row


def _guess_kind(config: Any) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal"
    if any(a.endswith(("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification")) for a in archs):
        return "encoder"
    return "causal" if getattr(config, "is_decoder", True) else "encoder"
