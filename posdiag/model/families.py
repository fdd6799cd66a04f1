"""Per-architecture quirks, in one table.

Every row says what breaks without it and how that was measured (transformers 5.24,
torch 2.13, CPU, tiny configs from `posdiag.testing.zoo`, eager attention). Checks never test a
family name themselves: they read a `Family` and its fields.

Unknown model types get `GENERIC`, whose fields are the safe defaults: positions and masks
are *measured* (mask fidelity, position_ids effect) before any verdict relies on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from posdiag.model.absolute_terms import llama_4_scaling_beta, softmax_scaling, temperature_tuning
from posdiag.model.injectors import bloom_mask, causal_buffers, falcon_alibi_mask, layer_mask_hook
from posdiag.model.kinds import Kind, PositionKind, declared_causal, guess_kind, masked_only
from posdiag.model.storage_mixing import storage_order_mixing, storage_positions
from posdiag.model.towers import is_multimodal, language_config

Refine = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """How to drive one architecture faithfully.

    kind:             a Kind: causal | encoder | seq2seq (which stacks exist and how they attend).
    position_kind:    a PositionKind: rope | learned | sinusoidal | alibi | relative_bias | none found.
    mask_form:        how an explicit attention pattern is handed over:
                      "4d"          one additive float [B,1,T,T] mask (a uniform window written in);
                      "layer_dict"  {"full_attention": m, "sliding_attention": m_w} by layer type;
                      "layer_hook"  no top-level mask: `injector` hands the pattern to every layer;
                      "none"        the family cannot take an explicit pattern (reason in mask_note).
    injector:         fn(subject, patterns) -> undo: for families whose layers do not (only) read
                      attention_mask (per-layer hooks, hard-coded causal buffers).
    position_ids:     "honoured" (passed and used), "ignored" (accepted via **kwargs and dropped:
                      positions derived inside), or "required" (must be passed with a 4D mask).
    position_offset:  index of the first position row in the learned table (OPT 2, RoBERTa pad+1).
    explicit_position_offset: added to logical positions when passing position_ids explicitly
                      (RoBERTa reads the ids as table rows; OPT adds its 2 inside).
    eager_only:       the family refuses attn_implementation="sdpa" in transformers 5.x.
    mask_note:        why mask_form is "none" (shown in skips).
    token_mixing:     "" when attention mixes the tokens; else what does instead (shown in reports). Such a
                      mixer reads the storage order itself, so a consistent permutation is no identity there.
    not_causal:       "" for a causal stack; else why a family that decodes left to right attends its input
                      bidirectionally by design (`causal` then has no future to judge).
    offsets_known:    position_offset / explicit_position_offset were measured for this row. False
                      for model types with no row: `table` then discovers which table row position 0
                      reads instead of assuming 0 (BioGPT, unknown to posdiag, reads row 2).
    absolute_by_design: how the family reads absolute positions on top of relative ones ("" when it
                      does not): relative invariance (`shift`) then cannot hold, by design.
    hold_absolute:    hold_absolute(model) -> (what was held, undo): that term held at its value at the first
                      positions (posdiag.model.absolute_terms), so `shift` judges the rest; None where it cannot be.
    offset_rows_in_context: max_position_embeddings counts the offset rows (RoBERTa: 514 rows for 512 tokens);
                      False where they come on top of it (Kosmos: max_position_embeddings + 2 rows).
    refine:           refine(config) -> the fields a config-dependent quirk changes ({} when none): Falcon's
                      alibi flag, RoBERTa's padding offset, MobileBERT's trigram input.
    """

    name: str
    kind: Kind = Kind.CAUSAL
    position_kind: PositionKind = PositionKind.NONE
    mask_form: str = "4d"
    position_ids: str = "honoured"
    position_offset: int = 0
    injector: Callable[[Any, dict], Callable[[], None]] | None = None
    explicit_position_offset: int = 0
    eager_only: bool = False
    mask_note: str = ""
    offsets_known: bool = True
    absolute_by_design: str = ""
    token_mixing: str = ""
    not_causal: str = ""
    offset_rows_in_context: bool = True
    refine: Refine | None = field(default=None, compare=False, repr=False)
    hold_absolute: Callable[[Any], tuple[str, Callable[[], None]]] | None = field(default=None, compare=False,
                                                                                  repr=False)

    def __post_init__(self) -> None:
        # replace(row, kind="causal") and rows built from strings keep the members (one spelling of each value)
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "position_kind", PositionKind(self.position_kind))

    @property
    def takes_position_ids(self) -> bool:
        return self.position_ids in ("honoured", "required")


GENERIC = Family(name="generic", offsets_known=False)


# ------------------------------------------------------------------ config-dependent quirks (a row's refine)
def _falcon_alibi(config: Any) -> dict[str, Any]:
    """Falcon-alibi builds the bias from the 2D mask like Bloom."""
    if not getattr(config, "alibi", False):
        return {}
    return dict(position_kind=PositionKind.ALIBI, mask_form="layer_hook", position_ids="ignored",
                injector=layer_mask_hook(falcon_alibi_mask))


def _padding_offsets(config: Any) -> dict[str, Any]:
    """RoBERTa's layout: own position ids from padding_idx + 1, explicit ids read as table rows."""
    offset = (getattr(config, "pad_token_id", None) or 0) + 1
    return dict(position_offset=offset, explicit_position_offset=offset)


def _prophetnet_offsets(config: Any) -> dict[str, Any]:
    pad = getattr(config, "pad_token_id", None) or 0
    return dict(position_offset=pad + 1, explicit_position_offset=pad + 2)


def _xlnet_attn_type(config: Any) -> dict[str, Any]:
    return dict(not_causal="") if getattr(config, "attn_type", "bi") == "uni" else {}


def _distilbert_tables(config: Any) -> dict[str, Any]:
    return dict(position_kind=PositionKind.SINUSOIDAL) if getattr(config, "sinusoidal_pos_embds", False) else {}


def _mobilebert_trigram(config: Any) -> dict[str, Any]:
    if not getattr(config, "trigram_input", False):
        return {}
    return dict(token_mixing="a 3-token convolution over the token embeddings (trigram_input)")


def _nystromformer_mixing(config: Any) -> dict[str, Any]:
    mixing = []
    if getattr(config, "conv_kernel_size", None):
        mixing.append(f"a {config.conv_kernel_size}-token depthwise convolution over the attention values")
    if getattr(config, "num_landmarks", 0) != getattr(config, "segment_means_seq_len", 0):
        mixing.append("Nystrom landmarks (means of consecutive segments)")
    return dict(token_mixing=" and ".join(mixing))


def _llama4_temperature(config: Any) -> dict[str, Any]:
    """Llama 4's attention temperature tuning (attn_temperature_tuning, on its NoPE layers: no_rope_layers 0) scales
    queries by a function of the absolute position, so a shift of every position is not invisible by design (vLLM
    numbers it by the position ids: a healthy model breaks shift once positions pass floor_scale - 1; transformers by
    the token's index in the sequence). `shift` holds it at 1 (absolute_terms) and judges the rest."""
    nope = [i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or ()) if not rope]
    if not getattr(config, "attn_temperature_tuning", False) or not nope:
        return {}
    term = (f"llama4 attention temperature tuning scales the queries of its NoPE layers ({', '.join(map(str, nope))}) "
            f"by log1p(floor((p + 1) / {config.floor_scale})) * {config.attn_scale} + 1 of the absolute position p")
    return dict(absolute_by_design=term, hold_absolute=temperature_tuning)


def _deberta_relative(config: Any) -> dict[str, Any]:
    """DeBERTa with relative_attention (every DeBERTa-v3): the disentangled c2p/p2c terms read relative positions
    built from the storage index (build_relative_position over q/k lengths), never from position_ids, so a
    consistent permutation is no identity (measured: 5.6e-5 off P f(x), 349x the floor, the same in float64).
    Without position_biased_input (v3) nothing reads position_ids at all."""
    if not getattr(config, "relative_attention", False):
        return {}
    mixing = "disentangled relative attention over positions taken from storage order (not from position_ids)"
    if getattr(config, "position_biased_input", True):  # v2-style: an absolute table read through position_ids too
        return dict(position_kind=PositionKind.LEARNED, token_mixing=mixing)
    return dict(position_kind=PositionKind.RELATIVE_BIAS, position_ids="ignored", token_mixing=mixing)


def _xlm_attention(config: Any) -> dict[str, Any]:
    """XLMWithLMHeadModel sits in the causal-LM mapping, but XLM's default (causal=False: MLM/TLM checkpoints)
    attends bidirectionally: judged as the encoder it is (measured: "query 0 sees key 1"). With causal=True the
    head decides, as for a type without a row."""
    return dict(kind=guess_kind(config) if getattr(config, "causal", False) else Kind.ENCODER)


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
    "falcon": Family("falcon", position_kind="rope", refine=_falcon_alibi),
    # Llama 4: its RoPE layers attend within chunks of attention_chunk_size (layer_types "chunked_attention"), its
    # NoPE layers the whole past: one 4D causal mask dropped the chunks (explicit != default at 0.51 on the tiny model,
    # chunk 8, 64 tokens: shuffle, positions and shift skipped), so a dict by layer type. Temperature tuning: see
    # _llama4_temperature.
    "llama4_text": Family("llama4_text", position_kind="rope", mask_form="layer_dict", refine=_llama4_temperature),
    # Beam: RoPE on sliding layers; its full-attention layers (rope_parameters entry None) scale queries by the
    # absolute position, (1 + (p + 1) / 2048) ** 0.1 (scalable softmax). Measured on the tiny model: a shift of 1
    # moves the outputs 1.39e-05 in float64 (93.7x its floor), 1.8e-07 with that scale held at 1.
    "beam": Family("beam", position_kind="rope", absolute_by_design="queries of its NoPE layers are scaled by "
                   "(1 + (p + 1) / 2048) ** 0.1 of the absolute position p (scalable softmax)"),
    # Mistral Large 4 multiplies its queries by a learned scale * log(p + 1) + bias per head (position ids p): a
    # shift of every position moves them by design. Its init (scale 0) hides it; a trained checkpoint's does not.
    "mistral_large4_text": Family("mistral_large4_text", offsets_known=False, hold_absolute=softmax_scaling,
                                  absolute_by_design="queries are scaled by a learned scale * log(p + 1) + bias per "
                                                     "head of the absolute position p (softmax scaling)"),
    # RecurrentGemma's RG-LRU resets its state where position_ids == 0 (document starts): a shift moves that reset.
    "recurrent_gemma": Family("recurrent_gemma", position_kind="rope", offsets_known=False,
                              absolute_by_design="its recurrence resets its state where position_ids is 0"),
    # --- Learned absolute tables ------------------------------------------------------------
    "gpt2": Family("gpt2", position_kind="learned"),
    # GPT-Neo ANDs a hard-coded causal `bias` buffer into every layer: a permuted mask cannot
    # open a future key until the buffer is opened (measured: "open" probe unchanged).
    "gpt_neo": Family("gpt_neo", position_kind="learned", injector=causal_buffers, eager_only=True),
    # OpenAI GPT (table `positions_embed`): the same hard-coded causal buffer, and its forward takes only a
    # 2D padding mask (a 4D one became 6D: RuntimeError in merge_heads), so the whole pattern goes into the
    # buffers and no attention_mask is passed. No SDPA (from_config refuses it) and no KV cache.
    "openai-gpt": Family("openai-gpt", position_kind="learned", mask_form="layer_hook", injector=causal_buffers,
                         eager_only=True),
    # OPT derives positions from the 2D mask cumsum (+2); with a 4D mask it needs explicit ids.
    "opt": Family("opt", position_kind="learned", position_ids="required", position_offset=2),
    # BioGPT adds 2 inside (OPT's table layout) but numbers positions by arange, and passed ids are
    # read as logical positions (+2 inside). Without the row the table probe looked at row 1 (read
    # by no position: a false FAIL); measured: row 3 read at position 1, omitted == passed ids.
    "biogpt": Family("biogpt", position_kind="learned", position_offset=2),
    # --- ALiBi: positions come from the 2D mask (Bloom, Falcon) or arange (MPT); position_ids
    #     are accepted and dropped (bit-identical outputs). --------------------------------
    "bloom": Family("bloom", position_kind="alibi", mask_form="layer_hook", position_ids="ignored", eager_only=True,
                    injector=layer_mask_hook(bloom_mask)),
    # MPT turns the mask into bool itself: an additive float mask works, a bool one reads inverted.
    "mpt": Family("mpt", position_kind="alibi", position_ids="ignored", eager_only=True),
    # --- Encoders: bidirectional; the permutation needs no mask at all. -----------------------
    "bert": Family("bert", kind="encoder", position_kind="learned"),
    # RoBERTa reads explicit position_ids as table rows; its own ids start at padding_idx + 1.
    "roberta": Family("roberta", kind="encoder", position_kind="learned", refine=_padding_offsets),
    # Same embeddings as RoBERTa (offset padding_idx + 1). Without a row they fell through to GENERIC and
    # never got RoBERTa's offsets.
    "xlm-roberta": Family("xlm-roberta", kind="encoder", position_kind="learned", refine=_padding_offsets),
    "camembert": Family("camembert", kind="encoder", position_kind="learned", refine=_padding_offsets),
    # sinusoidal_pos_embds: the table is filled with the sinusoidal formula instead of learned.
    "distilbert": Family("distilbert", kind="encoder", position_kind="learned", refine=_distilbert_tables),
    # RoFormer rotates q and k (interleaved pairs) by sin/cos read from a fixed sinusoidal table (embed_positions,
    # indexed by arange: no position_ids). Read as a learned table, `table` FAILed (markers in its rows move no
    # position: the rows feed a rotation, not the embeddings) and `shift` skipped a model that is relative by design.
    "roformer": Family("roformer", kind="encoder", position_kind="rope", position_ids="ignored"),
    # Local layers attend |q - k| <= local_attention // 2 (config.sliding_window): dict by layer type.
    "modernbert": Family("modernbert", kind="encoder", position_kind="rope", mask_form="layer_dict"),
    # FNet mixes tokens with a 2D Fourier transform (sequence x hidden), not attention, and takes no attention
    # mask. Measured: a consistent permutation differs from P f(x) by 1.07 in float32 and float64 alike.
    "fnet": Family("fnet", kind="encoder", position_kind="learned", token_mixing="a Fourier transform"),
    # MobileBERT's trigram input (config.trigram_input) concatenates each token's embedding with
    # its neighbours' before a linear map: a 3-token convolution in storage order, position ids aside. Measured
    # (default init): the "consistent" permutation differs from P f(x) by 0.30 in float32 and float64 (it was
    # taken as the noise floor: shuffle FAILed at 3.3x it); without trigram_input it reproduces P f(x) (2e-8).
    # Offsets: no row measured, table discovers them (offsets_known=False) as before the row existed.
    "mobilebert": Family("mobilebert", kind="encoder", position_kind="learned", offsets_known=False,
                         refine=_mobilebert_trigram),
    # Nystromformer adds a depthwise convolution over the values along the sequence (conv_kernel_size, 65 by
    # default) and, when num_landmarks < segment_means_seq_len, approximates softmax through landmarks that are
    # means of consecutive segments: both read storage order. Measured with the conv: the
    # consistent permutation is 3.3e-3 off P f(x) in float32 and float64; without it, 5.6e-8.
    "nystromformer": Family("nystromformer", kind="encoder", position_kind="learned", offsets_known=False,
                            refine=_nystromformer_mixing),
    # MPNet: a learned absolute table read through position_ids (so positions are absolute: no shift invariance)
    # plus a T5-style relative bias that MPNetEncoder computes from arange, i.e. storage order: compute_position_bias
    # takes position_ids but is never handed them (the docstring: position_ids index the position embeddings).
    # Detected as relative_bias before this row (shift judged it relative and FAILed at 0.99, the absolute table).
    "mpnet": Family("mpnet", kind="encoder", position_kind="learned", offsets_known=False,
                    token_mixing="a relative position bias computed from storage order (position_ids reach only its "
                                 "absolute table)"),
    # XLNet (a causal LM in transformers' mapping) with its default attn_type="bi": the content stream attends every
    # token, the future included, unless perm_mask says otherwise (permutation LM). Measured on the tiny model: changing
    # token 1 moves output 0 by 0.014 in float32 and float64 (causal FAILed); attn_type="uni" is causal.
    "xlnet": Family("xlnet", position_ids="ignored", refine=_xlnet_attn_type,
                    not_causal="attn_type='bi': every token attends every other (permutation LM; causal only with "
                               "attn_type='uni' or a perm_mask)"),
    # CPM-Ant: CpmAntModel builds its mask from a `context` that is all ones, so every input token sees every other
    # (a prefix LM: its labels give a masked-LM loss); cached steps see what precedes them only because they come last.
    # Its attention_mask is a "dummy parameter for text-generation pipeline": padding is id 0, found from the ids.
    # Measured: changing token 1 moves output 0 by 1.13 (causal FAILed); a padded row differs from itself alone by 1.0.
    "cpmant": Family("cpmant", position_kind="relative_bias", position_ids="ignored", mask_form="none",
                     mask_note="its attention_mask is a dummy parameter; id 0 is read as padding",
                     not_causal="CpmAntModel attends every input token bidirectionally (a context mask of all ones: a "
                                "prefix LM)"),
    # ProphetNet numbers positions from padding_idx + 1 (RoBERTa's layout, one more for explicit ids) and its decoder's
    # predicting streams read the main stream's id + 1, unclamped: the last row is reachable only by them, so the
    # usable context is rows - padding_idx - 2 (measured: 255 decoder tokens of a 256-row table raise IndexError).
    "prophetnet": Family("prophetnet", kind="seq2seq", position_kind="learned", position_ids="ignored",
                         refine=_prophetnet_offsets),
    # Kosmos-2 / 2.5 text: a sinusoidal table (max_position_embeddings + 2 rows, row padding_idx zeroed) read RoBERTa's
    # way: own ids from padding_idx + 1, explicit ids as rows. Passed 0-based, cached decode with ids 0..7
    # was 0.706 off the default full forward (float32 and float64); from padding_idx + 1 it agrees to 2e-7.
    "kosmos_2_text_model": Family("kosmos_2_text_model", position_kind="sinusoidal", offset_rows_in_context=False,
                                  refine=_padding_offsets),
    "kosmos_2_5_text_model": Family("kosmos_2_5_text_model", position_kind="sinusoidal", offset_rows_in_context=False,
                                    refine=_padding_offsets),
    # --- Encoder-decoders: the 4D pattern goes to decoder_attention_mask (a top-level mask would
    #     be reused as the cross-attention mask). Positions are derived inside. -----------------
    "t5": Family("t5", kind="seq2seq", position_kind="relative_bias", position_ids="ignored"),
    "bart": Family("bart", kind="seq2seq", position_kind="learned", position_ids="ignored", position_offset=2),
    "marian": Family("marian", kind="seq2seq", position_kind="sinusoidal", position_ids="ignored"),
    # Pegasus: Marian's fixed sinusoidal tables ([sin|cos], offset 0, no position_ids). Without the row
    # the table was taken for a learned one and never checked against the formula.
    "pegasus": Family("pegasus", kind="seq2seq", position_kind="sinusoidal", position_ids="ignored"),
    # mBART: BART's learned tables (offset 2, positions from arange + cache length, no position_ids).
    # Measured: row 3 read at position 1 in both stacks; passed position_ids change nothing.
    "mbart": Family("mbart", kind="seq2seq", position_kind="learned", position_ids="ignored", position_offset=2),
    # T5Gemma 2's decoder shares one softmax between self- and cross-attention (merged attention): the queries are
    # rotated at their decoder positions, the encoder keys beside the decoder's own are not, so every query's score
    # against the encoder reads its absolute position. Measured on the tiny model: a decoder shift of 1 moves the
    # outputs 0.038 (a left-padded row numbered from its first padding column: 0.0546 in float32 and in float64).
    "t5gemma2": Family("t5gemma2", kind="seq2seq", position_ids="ignored", offsets_known=False,
                       absolute_by_design="its merged attention scores rotated decoder queries against unrotated "
                                          "encoder keys in the same softmax, so a decoder query reads its absolute "
                                          "position"),
    # --- Rows with config-dependent quirks only: offsets unmeasured (`table` discovers them). ------------------
    # DeBERTa / DeBERTa-v2: the disentangled relative attention reads storage order (_deberta_relative).
    "deberta": Family("deberta", kind="encoder", offsets_known=False, refine=_deberta_relative),
    "deberta-v2": Family("deberta-v2", kind="encoder", offsets_known=False, refine=_deberta_relative),
    # XLM: bidirectional unless config.causal (_xlm_attention).
    "xlm": Family("xlm", offsets_known=False, refine=_xlm_attention),
}


def family_for(config: Any) -> Family:
    """The quirk row for a loaded config: its row refined by the config (`Family.refine`), or, for a model type
    without a row, GENERIC with what the config itself shows (sniffed: kind, storage-order mixing).

    A multimodal config (vision / audio towers around a language model) gets its language model's row
    under its own name: the checks drive the language model with text inputs (see `language_config`),
    so the text model's quirks (Gemma3's per-layer-type masks, Mistral's window) are the ones that apply.
    """
    if is_multimodal(config):
        return _multimodal(config)
    model_type = getattr(config, "model_type", None) or "generic"
    row = _ROWS.get(model_type)
    if row is None:
        return _scaled_queries(_sniffed(config, model_type), config)
    if row.kind == Kind.ENCODER and declared_causal(config):
        # The checkpoint says what it is: an encoder family configured as a decoder (is_decoder=True, or a
        # *ForCausalLM head) attends causally and decodes with a cache, so cache, generate and causal apply.
        row = replace(row, kind=Kind.CAUSAL)
    return _scaled_queries(replace(row, **row.refine(config)) if row.refine is not None else row, config)


def _scaled_queries(row: Family, config: Any) -> Family:
    """Llama 4's position scaling of the queries as Mistral's families declare it, whatever the row (Ministral 3,
    Mistral 4: rope_parameters["llama_4_scaling_beta"]): absolute by design, held at 1 by `shift`. Without this a
    healthy checkpoint broke shift once positions passed original_max_position_embeddings (16384 for Ministral 3)."""
    rope = getattr(config, "rope_parameters", None)
    beta = rope.get("llama_4_scaling_beta") if isinstance(rope, dict) else None
    if row.absolute_by_design or not beta:
        return row
    term = (f"queries are scaled by 1 + {beta} * log(1 + floor(p / {rope.get('original_max_position_embeddings')})) "
            "of the absolute position p (rope_parameters llama_4_scaling_beta)")
    return replace(row, absolute_by_design=term, hold_absolute=llama_4_scaling_beta)


def _multimodal(config: Any) -> Family:
    row = family_for(language_config(config))
    kind = Kind.SEQ2SEQ if getattr(config, "is_encoder_decoder", False) else Kind.CAUSAL
    if row.kind == Kind.ENCODER and masked_only(getattr(config, "model_type", None)):
        # A masked LM around a bidirectional text encoder (UltraVBert: an UltraBERT with a vision tower). Taken for
        # causal, its own default output "leaked" the future (0.25), the explicit causal mask did not reproduce it.
        kind = Kind.ENCODER
    return replace(row, name=getattr(config, "model_type", row.name), kind=kind)


def _sniffed(config: Any, model_type: str) -> Family:
    """A model type without a row: the safe defaults, with the kind and storage-order mixing the config shows."""
    kind = guess_kind(config)
    # posdiag hands encoder-decoder stacks no position_ids (Subject.forward): positions are
    # whatever the stacks derive inside, so a "consistent" permutation cannot be built.
    return replace(GENERIC, name=model_type, kind=kind, token_mixing=storage_order_mixing(config),
                   absolute_by_design=storage_positions(config),
                   position_ids="ignored" if kind == Kind.SEQ2SEQ else "honoured")


def for_model(family: Family, model: Any) -> Family:
    """The row refined by what the built model's forward declares: a forward that names no `position_ids` takes none
    (TrOCR, RoFormer, XLNet: its **kwargs drop them, positions come from arange), so they are "ignored", as in the
    rows measured for Bloom and MPT. Passed anyway, they were read as positions never honoured (a false FAIL)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return family
    if family.kind == Kind.SEQ2SEQ and "decoder_input_ids" not in params and "input_ids" in params:
        # An encoder-decoder's text decoder driven alone (Pix2StructTextModel, whose config keeps the encoder-decoder
        # flag): it takes no decoder inputs, so it is a causal LM.
        family = replace(family, kind=Kind.CAUSAL)
    if family.takes_position_ids and "position_ids" not in params:
        return replace(family, position_ids="ignored")
    return family
