"""Tiny models of any transformers model type, multimodal ones included, built from a small config on CPU.

``small_config(model_type)`` starts from the type's default config and shrinks the language model (2 layers,
4 heads of 16 dims, hidden 64, vocab 256) and every other tower (1 layer, hidden 32, 28-pixel images of 14-pixel
patches) with whatever size fields each sub-config has. Multimodal RoPE sections (``mrope_section``, which
Qwen-VL rotary classes default to a 128-dim head) are scaled to the small head: 4 + 2 + 2 of its 8 pairs.
Special text ids (padding, bos, eos, decoder start, ...) beyond the small vocabulary move to its top, below the
image/video/audio placeholder and delimiter ids (which take the top rows, so a prompt with an image can be built),
and the fields that depend on the headline sizes follow them (``posdiag.testing.shrink_rules``: latent attention,
experts, state-space and linear-attention heads, layer patterns). Placeholder ids the modelling code reads but the
config class does not declare are set as the model's other configs declare them. ``tiny_multimodal`` builds the
image-text-to-text model (``AutoModelForImageTextToText``) from it.

Hybrids keep an attention layer, as their checkpoints do, also where the default pattern has none
(GraniteMoeHybrid's default is all Mamba) or derives it from other fields (Jamba: attention at layer 4 of 8), so
keeping every layer type of the full default is not enough: when the small config has no attention layer and
the modelling code builds ``full_attention`` layers (or else the full default pattern has an attention type:
RecurrentGemma's ``sliding_attention``, derived from ``block_types``), the last layer becomes one (``layer_types``,
or ``attn_layer_indices`` where the pattern derives from it: Bamba's default is all Mamba), or else the layer count
grows (up to 8) until the default pattern reaches its first attention layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posdiag.testing.shrink_rules import (
    experts,
    latent_attention,
    linear_attention_heads,
    linked_widths,
    listed_sizes,
    mixer_heads,
    nested_configs,
    parts_of_sizes,
    per_layer,
    per_layer_overrides,
    placeholder_ids,
    repeated_pattern,
    required_defaults,
    undeclared_placeholders,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from transformers import PretrainedConfig

# The language model's sizes; fields a config does not have are left out.
TEXT_SIZES: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, intermediate_size_mlp=128, moe_intermediate_size=32, vocab_size=256,
    unpadded_vocab_size=240, decoder_vocab_size=256, encoder_hash_byte_group_vocab=256,
    vocab_size_per_layer_input=256,
    max_position_embeddings=256, sliding_window=128, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, num_layers=2, num_heads=4, d_ff=128, d_kv=16,
)  # fmt: skip
# sliding_window: half the small context, so checks that run past the window (cache) see it act within 256 tokens; left
# at RecurrentGemma's 2048 with no declared context, its cache check ran 2052 tokens (90 s).
# unpadded_vocab_size (Inkling2): the head's rows, fewer than the padded embedding's (200058 of 201024); left at its
# default the head would emit ids past the 256-row embedding and generate() would feed them back (IndexError).
# Vision / audio towers: as small as their patching allows.
TOWER_SIZES: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2, intermediate_size=64,
    embed_dim=32, image_size=28, patch_size=14, out_hidden_size=64, projector_input_dim=64,
    projector_output_dim=64, vision_output_dim=64, num_layers=1, encoder_layers=1, d_model=32, codebook_dim=32,
)  # fmt: skip
MROPE_SECTION = [4, 2, 2]  # t/h/w pairs of the 8 a 16-dim head rotates (Qwen2-VL's [16, 24, 24] of 64, scaled)
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "vision_tower_config", "speech_config")


SPECIAL_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# The text's own special ids: a default beyond the small vocabulary (Phi-3's padding id 32000, Whisper's decoder
# start 50257) is moved to its top, below the placeholder ids above; ids that were equal stay equal.
TEXT_TOKENS = tuple(f"{k}_token_id" for k in ("pad", "bos", "eos", "decoder_start", "sep", "cls", "mask", "unk",
                                               "forced_bos", "forced_eos"))
# layer_types entries that are no attention: recurrent / convolutional mixers and MLP-only layers.
_NOT_ATTENTION = frozenset({"linear_attention", "mamba", "conv", "moe", "dense", "sparse"})


def small_config(model_type: str, *, image_tokens_in_vocab: bool = True, **text_overrides: Any) -> PretrainedConfig:
    """The default config of ``model_type`` with every tower shrunk (``text_overrides`` win for the text model).

    The image/video/audio placeholder ids (and their start/end delimiters) move to the top of the small vocabulary,
    so a prompt with an image can be built (random probe text never holds one: Subject.sample_ids leaves special ids
    out); ``image_tokens_in_vocab=False`` keeps their large defaults, outside the embedding."""
    try:
        config = _small(model_type, image_tokens_in_vocab, text_overrides)
    except Exception as exc:  # the config takes no grouped key/value heads (ESM-C, dots3, GLM-5): one per head
        if "key_value_heads" not in str(exc) or "num_key_value_heads" in text_overrides:
            raise
        heads = text_overrides.get("num_attention_heads", TEXT_SIZES["num_attention_heads"])
        text_overrides = {**text_overrides, "num_key_value_heads": heads}
        config = _small(model_type, image_tokens_in_vocab, text_overrides)
    if "layer_types" in text_overrides or "num_hidden_layers" in text_overrides or _has_attention(config):
        return config
    attention = "full_attention" if _builds_full_attention(config) else _default_attention(model_type)
    if attention is None:
        return config
    types = _text(config).layer_types
    last = len(types) - 1
    tries = [{"layer_types": [*types[:-1], attention]}, {"attn_layer_indices": [last]}] \
        + [{"num_hidden_layers": n} for n in range(3, 9)]
    for extra in tries:
        try:
            candidate = _small(model_type, image_tokens_in_vocab, {**text_overrides, **extra})
        except Exception:  # the config does not take this layer pattern: try the next
            continue
        if _has_attention(candidate):
            return candidate
    return config


def _small(model_type: str, image_tokens_in_vocab: bool, text_overrides: dict[str, Any]) -> PretrainedConfig:
    import transformers

    config_class = type(transformers.AutoConfig.for_model(model_type))
    base = config_class()
    kwargs: dict[str, Any] = {}
    text_sizes = {**_text_sizes(_text(base)), **text_overrides}
    for name in _SUB_CONFIGS:
        sub = getattr(base, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        sizes = text_sizes if name == "text_config" else TOWER_SIZES
        kwargs[name] = _shrunk(sub, sizes)
        if name == "vision_config" and "embed_dim" in kwargs[name] and "hidden_size" in kwargs[name]:
            # Qwen2-VL's tower: embed_dim is its width, hidden_size the merger's output (the language model's)
            kwargs[name]["hidden_size"] = text_overrides.get("hidden_size", TEXT_SIZES["hidden_size"])
        if name != "text_config":  # a tower's text_* size is the language model's (Inkling2's text_hidden_size)
            kwargs[name].update({k: text_sizes[k[5:]] for k in sub.to_dict() if k[5:] in text_sizes
                                 and k.startswith("text_")})
            kwargs[name].update(_outputs_to_text(sub, _text(base), text_sizes, kwargs[name]))
    vocab = text_overrides.get("vocab_size", TEXT_SIZES["vocab_size"])
    text = getattr(base, "text_config", None)
    placed = placeholder_ids(base, SPECIAL_TOKENS, vocab) if image_tokens_in_vocab else {}
    moves = _token_moves([base, text or {}], vocab, max(len(SPECIAL_TOKENS), len(placed)))
    nested = nested_configs(base, text_sizes, TOWER_SIZES, _shrunk, set(_SUB_CONFIGS))
    for name, fields in nested.items():
        kwargs[name] = {**kwargs.get(name, {}), **fields}
    if kwargs and text is None:  # the language model is the top level itself (IDEFICS, Phi-4-multimodal)
        kwargs.update({k: v for k, v in _shrunk(base, text_sizes).items() if k != "model_type"})
    if "text_config" in kwargs:
        kwargs["text_config"].update(_moved(text.to_dict(), moves))
    if not kwargs:  # a text-only config: shrink it directly
        fields = _shrunk(base, text_sizes)
        fields.pop("model_type")
        return transformers.AutoConfig.for_model(model_type, **{**fields, **_moved(base.to_dict(), moves), **placed,
                                                                **required_defaults(base, _modelling_source(base))})
    kwargs.update(placed)
    placeholders = undeclared_placeholders(base, SPECIAL_TOKENS, _modelling_source(base))
    if image_tokens_in_vocab:
        placeholders = {k: vocab - 1 - SPECIAL_TOKENS.index(k) for k in placeholders}
    return config_class(**kwargs, **_moved(base.to_dict(), moves), **placeholders)


def _outputs_to_text(tower: Any, text: Any, text_sizes: dict[str, Any], done: dict[str, Any]) -> dict[str, Any]:
    """A tower's output width set to the language model's hidden size where the default has them equal (dots3's
    adapter_out_dim, which its config requires to match the text hidden size)."""
    width = getattr(text, "hidden_size", None) if text is not tower else None
    return {k: text_sizes["hidden_size"] for k, v in tower.to_dict().items() if k not in done and "out" in k
            and ("dim" in k or "size" in k) and isinstance(width, int) and v == width and not isinstance(v, bool)}


def _text_sizes(text: Any) -> dict[str, Any]:
    """TEXT_SIZES for this language model: a sliding_window its type leaves unset stays unset where the text model's
    forward builds no sliding-window mask. DynamicCache(config) infers sliding layers from the field alone, so a window
    the forward never applies made cached decoding keep window - 1 tokens while the full forward attended all of
    them (Qwen3-VL-MoE, whose config pins it to None, and Qwen3-Omni's thinker, whose checkpoints carry null: 0.2
    relative at the first step past the window, the same in float64). Types that set a window keep it shrunk."""
    if text.to_dict().get("sliding_window", 0) is not None or _applies_window(text):  # per-layer windows: a dict
        return TEXT_SIZES
    return {k: v for k, v in TEXT_SIZES.items() if k != "sliding_window"}


def _applies_window(config: Any) -> bool:
    """Whether a model class built on this config builds a sliding-window mask in its forward (Mistral, Phi-3 and
    Qwen2 do when their window is set, from a default of None)."""
    import importlib
    import inspect

    module_name = type(config).__module__.replace("configuration_", "modeling_")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # no modelling module of that name: keep the window
        return True
    classes = [c for c in vars(module).values() if isinstance(c, type) and "forward" in vars(c)
               and getattr(c, "config_class", None) is type(config)]
    return not classes or any("sliding" in inspect.getsource(c.forward) for c in classes)


def _token_moves(configs: list[Any], vocab: int, placeholders: int) -> dict[int, int]:
    """Each special text id at or beyond ``vocab`` -> its id near the top of the vocabulary, below the top
    ``placeholders`` ids (the image/video placeholders' slots)."""
    ids = [v for c in configs for k in TEXT_TOKENS for v in _ids(_get(c, k))]
    beyond = sorted({i for i in ids if i >= vocab})
    return {old: vocab - 1 - placeholders - n for n, old in enumerate(beyond)}


def _moved(fields: dict[str, Any], moves: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in TEXT_TOKENS:
        value = fields.get(k)
        if isinstance(value, int) and value in moves:
            out[k] = moves[value]
        elif isinstance(value, (list, tuple)) and any(v in moves for v in value):
            out[k] = [moves.get(v, v) for v in value]
    return out


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, (list, tuple)) else []


def _text(config: Any) -> Any:
    text = getattr(config, "text_config", None)
    return text if text is not None and hasattr(text, "to_dict") else config


def _has_attention(config: Any) -> bool:
    """Whether the language model has an attention layer (or declares no layer pattern at all)."""
    types = getattr(_text(config), "layer_types", None)
    return not isinstance(types, (list, tuple)) or not types or any(t not in _NOT_ATTENTION for t in types)


def _default_attention(model_type: str) -> str | None:
    """The first attention layer type of the full default pattern (None: it has none). RecurrentGemma derives its
    pattern from ``block_types`` (recurrent, recurrent, attention) as sliding_attention layers, so its first two
    layers, all a 2-layer model keeps, are both recurrent."""
    import transformers

    types = getattr(_text(transformers.AutoConfig.for_model(model_type)), "layer_types", None) or []
    return next((t for t in types if t not in _NOT_ATTENTION), None)


def _builds_full_attention(config: Any) -> bool:
    """Whether the modelling code of the language model dispatches a ``full_attention`` layer type."""
    return '"full_attention"' in _modelling_source(_text(config))


def _shrunk(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    fields = config.to_dict()
    # A size can be stored under the config's own name (attribute_map): GPT-J's hidden_size is n_embd, XLM's emb_dim.
    # Matching only the standard names left GPT-J and CodeGen at 28 layers of 4096 (6B parameters).
    out = {}
    for name, value in sizes.items():
        stored = name if name in fields else _stored(config, name)
        if stored in fields:
            out.setdefault(stored, value)
    out["model_type"] = config.model_type
    if {"n_input_layers", "n_output_layers"} <= fields.keys():
        # A looped model's layers come in sections that add up to num_hidden_layers (Dory: input, recurrent, output).
        # The default 8 + 8 around 2 shrunk layers left a negative recurrent section, so every layer ran twice and
        # wrote its cache twice: one layer per section, the recurrent one derived.
        out.update(num_hidden_layers=3, n_input_layers=1, n_output_layers=1)
        if "n_recurrent_layers" in fields:
            out["n_recurrent_layers"] = None
    out.update(listed_sizes(fields, out))
    if sizes is not TOWER_SIZES:
        if "num_key_value_heads" in fields and "num_attention_heads" in out and not _repeats_heads(config):
            out["num_key_value_heads"] = out["num_attention_heads"]
        out.update(latent_attention(fields, {**TEXT_SIZES, **sizes}, TEXT_SIZES["head_dim"]))
        out.update(linear_attention_heads(config, {**TEXT_SIZES, **sizes}))
        out.update(experts(fields))
        out.update(mixer_heads(fields, out))
        out.update(repeated_pattern(fields, out))
    out.update(_every_layer_type(config, fields, out, sizes))
    out.update(per_layer(fields, out))
    out.update(parts_of_sizes(fields, out))
    out.update(linked_widths(fields, out))
    out.update(per_layer_overrides(fields, out))
    out.update(_rotary_dim(config, fields, out))
    if sizes is TOWER_SIZES and fields.get("deepstack_visual_indexes"):
        # Qwen3-VL's deepstack layers (8, 16, 24 of 27) lie past the 1-layer tower: none would be read, and generate()'s
        # chunked prefill, which slices the deepstack features per chunk, crashed on the empty list. Its only layer.
        out["deepstack_visual_indexes"] = [0]
    rope = dict(getattr(config, "rope_parameters", None) or {})
    nested = bool(rope) and all(isinstance(v, dict) for v in rope.values())  # per layer type: where one has it
    if nested:
        rope = {k: {**v, "mrope_section": list(MROPE_SECTION)} if "mrope_section" in v else v for k, v in rope.items()}
    elif "mrope_section" in rope or rope and _reads_mrope(config):
        rope["mrope_section"] = list(MROPE_SECTION)
    if rope:
        out["rope_parameters"] = rope
    return out


def _every_layer_type(config: Any, fields: dict[str, Any], out: dict[str, Any], sizes: dict[str, Any]) -> dict:
    """layer_types (and the layer count) so that every layer type of the full model has a layer: the first two of
    Flint's 49 layers are both full attention, which runs without RoPE, so a 2-layer Flint had no position
    mechanism at all; Gemma3's and Cohere2's first two are both sliding. Types keep their first-seen order."""
    types = list(getattr(config, "layer_types", None) or [])
    layers = out.get("num_hidden_layers")
    name = (getattr(type(config), "attribute_map", None) or {}).get("layer_types", "layer_types")  # Zamba's alias
    if name not in fields or "layer_types" in sizes or not layers or set(types[:layers]) == set(types):
        return {}
    kinds = list(dict.fromkeys(types))
    layers = max(layers, len(kinds))
    return {"num_hidden_layers": layers, name: [kinds[i % len(kinds)] for i in range(layers)]}


def _repeats_heads(config: Any) -> bool:
    """Whether the eager attention of the config's modelling module repeats key/value heads for grouped queries
    (Unlimited-OCR's and ESM-C's do not: their small configs keep one key/value head per query head)."""
    import importlib
    import inspect

    module_name = type(config).__module__.replace("configuration_", "modeling_")
    try:
        source = inspect.getsource(importlib.import_module(module_name).eager_attention_forward)
    except Exception:  # no such module or function: the attention classes decide
        return True
    return "repeat_kv" in source or "num_key_value_groups" in source


def _rotary_dim(config: Any, fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A rotary_dim (GPT-J, CodeGen: 64 of a 256-dim head) kept as the same share of the small head: left at 64 it
    exceeds the 16-dim head and the rotation no longer fits."""
    rotary, hidden, heads = fields.get("rotary_dim"), fields.get(_stored(config, "hidden_size")), \
        fields.get(_stored(config, "num_attention_heads"))  # per-layer heads (dots3) raise on attribute reads
    small_hidden, small_heads = out.get(_stored(config, "hidden_size")), out.get(_stored(config, "num_attention_heads"))
    if not all(isinstance(v, int) and v > 0 for v in (rotary, hidden, heads, small_hidden, small_heads)):
        return {}
    small_head = small_hidden // small_heads
    return {"rotary_dim": min(small_head, max(2, 2 * round(rotary * small_head / (hidden // heads) / 2)))}


def _stored(config: Any, name: str) -> str:
    """The name a config stores a standard field under (attribute_map: GPT-J's hidden_size is n_embd)."""
    return (getattr(config, "attribute_map", None) or {}).get(name, name)


def _reads_mrope(config: Any) -> bool:
    """Whether the model of this config rotates by mRoPE sections (its modelling code reads mrope_section)."""
    return "mrope_section" in _modelling_source(config)


def _modelling_source(config: Any) -> str:
    """The source of the modelling module next to the config's class ("" when there is none)."""
    import importlib
    import inspect

    module_name = type(config).__module__.replace("configuration_", "modeling_")
    try:
        return inspect.getsource(importlib.import_module(module_name))
    except Exception:  # no modelling module of that name
        return ""


def small_model(model_type: str, *, seed: int = 0, config: PretrainedConfig | None = None,
                **text_overrides: Any) -> nn.Module:
    """The sweep's tiny model of ``model_type``: ``small_config`` (or ``config``), the auto class posdiag loads that
    config with, eager attention where the class takes it; eval mode, transformers' default init seeded."""
    import torch

    from posdiag.model.classes import auto_class
    from posdiag.model.families import family_for

    given = config
    config = config if config is not None else small_config(model_type, **text_overrides)
    auto = auto_class(config, family_for(config))
    torch.manual_seed(seed)
    try:
        try:
            model = auto.from_config(config, attn_implementation="eager")
        except (ValueError, TypeError) as exc:  # a class that takes no eager attention choice
            if "tie" in str(exc):
                raise
            model = auto.from_config(config)
    except ValueError as exc:
        # A block shared by several layers (Zamba's shared transformer) is tied from one of them to the others;
        # with one such layer in two transformers finds nothing to tie and raises: the layer pattern twice.
        types = getattr(_text(config), "layer_types", None)
        if given is not None or "tie" not in str(exc) or not types or "layer_types" in text_overrides:
            raise
        return small_model(model_type, seed=seed, **text_overrides, layer_types=[*types, *types],
                           num_hidden_layers=2 * len(types))
    return model.eval()


def tiny_multimodal(model_type: str, *, seed: int = 0, attn_implementation: str | None = "eager",
                    image_tokens_in_vocab: bool = False, **text_overrides: Any) -> nn.Module:
    """A tiny image-text-to-text model of ``model_type`` (eval mode, default init seeded with ``seed``)."""
    import torch
    import transformers

    config = small_config(model_type, image_tokens_in_vocab=image_tokens_in_vocab, **text_overrides)
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return transformers.AutoModelForImageTextToText.from_config(config, **kwargs).eval()
