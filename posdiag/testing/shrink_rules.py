"""Rules that keep a shrunk config consistent with itself, each derived from the config's own fields.

``posdiag.testing.multimodal`` sets the headline sizes (hidden size, heads, layers); the rules here size the fields
that depend on them, as the full default has them: latent attention, experts, state-space and linear-attention heads,
per-stage lists, layer patterns, and size fields reached through a config's ``attribute_map``; and placeholder ids the
modelling code reads that the config class leaves undeclared.
"""

from __future__ import annotations

import math
import re
from typing import Any

# Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, ...): one query/key head is a 16-dim part without
# RoPE and a 16-dim rotated part (the small head), values 16 dims, both low-rank projections 32; a config's head_dim
# is either the rotated part (DeepSeek) or the whole query/key head (Mistral 4), as in its default. Sizes the default
# leaves unused (0 or None: GLM-5-Next's attention has no rotated part, Kimi's no query projection) stay so.
LATENT_SIZES: dict[str, Any] = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
                                    q_lora_rank=32, index_head_dim=32, index_n_heads=2)
# Mixture-of-experts fields beyond the headline num_experts: set only where the default uses them (not None/0).
EXPERT_SIZES: dict[str, Any] = dict(n_routed_experts=4, num_experts_per_token=2, moe_topk=2,
                                    expert_ffn_hidden_size=32, zero_expert_num=2)


def latent_attention(fields: dict[str, Any], sizes: dict[str, Any], small_head: int) -> dict[str, Any]:
    """LATENT_SIZES for a config with latent attention: left to the headline head_dim alone, the rotated part kept
    its 64 dims against a 16-dim head, and 2 key/value heads were repeated to 8 against 4 query heads."""
    if "qk_rope_head_dim" not in fields or "kv_lora_rank" not in fields:
        return {}
    out = {k: v for k, v in LATENT_SIZES.items() if fields.get(k) and k not in sizes}
    if "num_key_value_heads" in fields:  # keys and values come per head out of the latent: no grouped heads
        out["num_key_value_heads"] = sizes["num_attention_heads"]
    nope = out.get("qk_nope_head_dim", fields.get("qk_nope_head_dim") or 0)
    rope = out.get("qk_rope_head_dim", fields.get("qk_rope_head_dim") or 0)
    if fields.get("qk_head_dim") is not None:
        out["qk_head_dim"] = nope + rope
    head = fields.get("head_dim")
    if head is not None and rope and sizes.get("head_dim") == small_head:  # unless head_dim is overridden
        whole = head == (fields.get("qk_nope_head_dim") or 0) + fields["qk_rope_head_dim"]
        out["head_dim"] = nope + rope if whole else rope
    return out


def experts(fields: dict[str, Any]) -> dict[str, Any]:
    """Few experts, in the default's arrangement: a shared expert and a leading dense layer where the default has
    them (first_k_dense_replace 3 of 61 layers would make both small layers dense), 2 expert groups of 2 with one
    picked where the router is group-limited, and one expert per token where the default routes to one (ZAYA)."""
    out = {k: v for k, v in EXPERT_SIZES.items() if fields.get(k)}
    for name in ("n_shared_experts", "num_shared_experts", "first_k_dense_replace"):
        if fields.get(name):
            out[name] = 1
    for name in ("n_group", "num_expert_group"):
        if (fields.get(name) or 0) > 1:
            out[name] = 2
    if (fields.get("topk_group") or 0) > 1:
        out["topk_group"] = 1
    if fields.get("num_experts_per_tok") == 1:
        out["num_experts_per_tok"] = 1
    return out


def mixer_heads(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A state-space mixer's heads span its expanded width (Mamba-2: num_heads * head_dim = expand * hidden_size),
    so the head count follows the small width and head; the groups divide the heads."""
    if not {"expand", "num_heads", "head_dim", "hidden_size"} <= fields.keys() or "hidden_size" not in out:
        return {}
    if fields["num_heads"] * fields["head_dim"] != fields["expand"] * fields["hidden_size"]:
        return {}
    head = out.get("head_dim", fields["head_dim"])
    heads = int(fields["expand"] * out["hidden_size"]) // head
    update: dict[str, Any] = {"num_heads": heads}
    if fields.get("n_groups"):
        update["n_groups"] = math.gcd(fields["n_groups"], heads)
    return update


def repeated_pattern(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A layer pattern given as [[pattern, repeats]] (GPT-Neo's attention_types) repeated to cover the small
    layer count, which is rounded up to whole patterns."""
    spec = fields.get("attention_types")
    layers = out.get("num_layers", out.get("num_hidden_layers"))
    if not isinstance(spec, list) or not spec or not isinstance(spec[0], (list, tuple)) or not layers:
        return {}
    pattern = list(spec[0][0])
    repeats = max(1, math.ceil(layers / len(pattern)))
    update: dict[str, Any] = {"attention_types": [[pattern, repeats]]}
    for name in ("num_layers", "num_hidden_layers"):
        if name in out:
            update[name] = repeats * len(pattern)
    return update


def listed_sizes(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A size the default gives as a list (Molmo2's image_size [378, 378], ERNIE-VL's per-modality
    moe_intermediate_size) stays a list of the same length."""
    return {k: [v] * len(fields[k]) for k, v in out.items()
            if isinstance(v, int) and isinstance(fields.get(k), (list, tuple)) and fields[k]}


def undeclared_placeholders(config: Any, names: tuple[str, ...], modelling_source: str) -> dict[str, Any]:
    """Placeholder ids the modelling code reads from this config although its class declares no default, set to the
    default another config class of the same model declares. Qwen2.5-Omni's and Qwen3-Omni's thinkers compute their
    mRoPE positions from ``config.vision_start_token_id`` on every forward without position_ids; the thinker configs
    lack the field (their talker configs declare it: 151652), while the released checkpoints' thinker configs and
    transformers' own tests set it. Left out, every call without position_ids raised AttributeError."""
    import importlib
    import inspect
    import re

    read = set(re.findall(r"\bconfig\.(\w+)\b", modelling_source))
    missing = [n for n in names if n in read and not hasattr(config, n)]
    if not missing:
        return {}
    module = importlib.import_module(type(config).__module__)
    siblings = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    out: dict[str, Any] = {}
    for name in missing:
        declared = [getattr(c, name) for c in siblings if isinstance(getattr(c, name, None), int)]
        if declared:
            out[name] = declared[0]
    return out


# Placeholder and delimiter ids of images, video and audio a config may hold beyond the four main ones: GLM-4V's
# image/video start and end ids, HunYuan-VL's im_start_id / im_end_id / im_newline_id, the Qwen omni thinkers' audio
# ids, Gemma 3's boi/eoi, LLaVA's image_token_index.
_PLACEHOLDER = re.compile(r"^(image|video|vision|audio|im|boi|eoi)_\w*(token_id|token_index|_id)$")


def placeholder_ids(config: Any, first: tuple[str, ...], vocab: int) -> dict[str, int]:
    """The image/video/audio placeholder and delimiter ids of ``config`` moved to the top of a ``vocab``-row
    vocabulary: the ``first`` names (those the config has) to ``vocab - 1 - index``, then every other such id the
    config keeps beyond the vocabulary, below them. An image prompt needs them inside the embedding: the
    decode-after-image probe refused every Qwen-VL type while its image token 151655 sat past the 256 rows."""
    out = {k: vocab - 1 - i for i, k in enumerate(first) if getattr(config, k, None) is not None}
    extra = sorted(k for k, v in config.to_dict().items() if k not in first and _PLACEHOLDER.match(k)
                   and isinstance(v, int) and not isinstance(v, bool) and v >= vocab)
    out.update({k: vocab - 1 - len(first) - n for n, k in enumerate(extra)})
    return out


def linear_attention_heads(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """A linear-attention mixer (Kimi delta attention: Kimi Linear, GLM-5-Next; gated delta rule: Qwen3-Next, Qwen3.5)
    gets the small attention's head size and count, value heads keeping the default's share of key heads, as
    Bailing-Hybrid's and OLMo-Hybrid's configs derive theirs (left None in those classes, so not set here). Left at
    GLM-5-Next's 64 heads of 128 dims (a 8192-wide mixer on a 64-wide model), its chunked kernel's per-channel decay
    mask for a batch of 17 rows took 2.3 GB and the causal check ran out of the sweep's 6 GB."""
    head, heads = sizes["head_dim"], sizes["num_attention_heads"]
    declared = {k: getattr(type(config), k, None) for k in ("linear_num_heads", "linear_head_dim",
                                                             "linear_num_key_heads", "linear_num_value_heads",
                                                             "linear_key_head_dim", "linear_value_head_dim")}
    declared = {k: v for k, v in declared.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    out: dict[str, Any] = {}
    if "linear_num_heads" in declared:
        out["linear_num_heads"] = heads
    if "linear_head_dim" in declared:
        out["linear_head_dim"] = head
    if {"linear_num_key_heads", "linear_num_value_heads"} <= declared.keys():
        share = declared["linear_num_value_heads"] // declared["linear_num_key_heads"] or 1
        out.update(linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // share))
    if {"linear_key_head_dim", "linear_value_head_dim"} <= declared.keys():
        out.update(linear_key_head_dim=head,
                   linear_value_head_dim=head * declared["linear_value_head_dim"] // declared["linear_key_head_dim"])
    return out


# Sub-configs whose name says they are a vision or audio tower are shrunk as towers; others as their parent is.
TOWER_NAMES = ("vision", "audio", "speech", "sam", "image", "perceiver")


def nested_configs(base: Any, text_sizes: dict[str, Any], tower_sizes: dict[str, Any], shrink: Any,
                   handled: set[str]) -> dict[str, Any]:
    """Every sub-config the config class declares (``sub_configs``) shrunk, at any depth: BLT's patcher, local
    encoder/decoder and global transformer, T5Gemma's encoder and decoder, PI0's PaliGemma and action expert,
    DeepSeek-OCR-2's SAM and Qwen2 encoders inside its vision tower. Left at their defaults they kept 4.6B (BLT) to
    5.6B (T5Gemma) parameters, past the sweep's 6 GB. ``handled`` top-level names are shrunk by the caller; only their
    own sub-configs are added. A field naming another module's width (T5Gemma's cross_attention_hidden_size, BLT's
    hidden_size_global) follows the module whose default width it equals."""
    widths: dict[int, set[int]] = {}

    def collect(config: Any, sizes: dict[str, Any]) -> None:
        if isinstance(getattr(config, "hidden_size", None), int) and "hidden_size" in sizes:
            widths.setdefault(config.hidden_size, set()).add(sizes["hidden_size"])
        for _, sub, sub_sizes in _children(config, sizes, text_sizes, tower_sizes):
            collect(sub, sub_sizes)

    def walk(config: Any, sizes: dict[str, Any], top: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, sub, sub_sizes in _children(config, sizes, text_sizes, tower_sizes):
            children = walk(sub, sub_sizes, False)
            if top and name in handled:
                if children:
                    out[name] = children
                continue
            fields = {**shrink(sub, sub_sizes), **children}
            # the sub-config's own switches survive the rebuild (VisionEncoderDecoder's decoder: is_decoder and
            # add_cross_attention; rebuilt from sizes alone it became a BERT encoder)
            fields.update({k: v for k, v in sub.to_diff_dict().items() if isinstance(v, bool) and k not in fields})
            fields.update(_ids_within(sub.to_dict(), fields.get("vocab_size")))
            for key, value in sub.to_dict().items():
                if "hidden_size" in key and key not in fields and len(widths.get(value, ())) == 1 \
                        and not isinstance(value, bool):
                    fields[key] = next(iter(widths[value]))
            out[name] = fields
        return out

    collect(base, text_sizes)
    return walk(base, text_sizes, True)


def _ids_within(values: dict[str, Any], vocab: Any) -> dict[str, int]:
    """Token ids of a shrunk sub-config moved to the top of its new vocabulary, in their order (NemoSpeechLM's word
    timestamp head: blank_token_id 23862 of 23863, left as is past the shrunk vocabulary, failed validation)."""
    if not isinstance(vocab, int):
        return {}
    ids = {k: v for k, v in values.items() if k.endswith("token_id") and isinstance(v, int)
           and not isinstance(v, bool) and v >= vocab}
    beyond = sorted(set(ids.values()))
    return {k: vocab - len(beyond) + beyond.index(v) for k, v in ids.items()}


def _children(config: Any, sizes: dict[str, Any], text_sizes: dict[str, Any], tower_sizes: dict[str, Any]) -> list:
    out = []
    for name in getattr(type(config), "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        kind = tower_sizes if any(t in name for t in TOWER_NAMES) else text_sizes if name == "text_config" else sizes
        out.append((name, sub, kind))
    return out


def per_layer(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Lists with one entry per layer of the full default (Gemma 3n's intermediate_size and
    activation_sparsity_pattern, 35 each) keep their first entries, one per small layer; the count of trailing layers
    that share another layer's keys and values (Gemma 3n's num_kv_shared_layers, 15 of 35) keeps its share, rounded
    down. Left at 35 entries against 2 layers, the config refused itself."""
    full, small = fields.get("num_hidden_layers"), out.get("num_hidden_layers")
    if not isinstance(full, int) or not isinstance(small, int) or full <= small:
        return {}
    update: dict[str, Any] = {}
    for key, value in fields.items():
        value = out.get(key, value)
        if key != "layer_types" and isinstance(value, list) and len(value) == full:
            update[key] = value[:small]
        elif "shared_layers" in key and isinstance(value, int) and 0 < value < full:
            update[key] = value * small // full
    return update


def parts_of_sizes(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A list that splits a shrunk size into parts keeps the parts' shares: Reformer's axial position embedding
    dims (64 + 192 of a 256 hidden size) and its axial shape (64 x 64 = 4096 positions), which the model checks
    against hidden_size and max_position_embeddings."""
    update: dict[str, Any] = {}
    for key, value in fields.items():
        if key in out or not isinstance(value, list) or len(value) < 2 \
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            continue
        for name, small in out.items():
            full = fields.get(name)
            if not isinstance(small, int) or not isinstance(full, int) or full < 64 or small >= full:
                continue
            if sum(value) == full and all(v * small % full == 0 for v in value):
                update[key] = [v * small // full for v in value]
            elif math.prod(value) == full and round(small ** (1 / len(value))) ** len(value) == small:
                update[key] = [round(small ** (1 / len(value)))] * len(value)
            else:
                continue
            break
    return update


def linked_widths(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A width field that equals the hidden size in the default (SqueezeBERT's embedding_size, which its first
    layer requires to equal hidden_size; dots3's adapter_in_dim and adapter_input_size) follows the small one."""
    full, small = fields.get("hidden_size"), out.get("hidden_size")
    if not isinstance(full, int) or not isinstance(small, int):
        return {}
    return {k: small for k, v in fields.items() if k not in out and v == full and not isinstance(v, bool)
            and (k == "embedding_size" or "hidden_size" in k or k.endswith(("in_dim", "input_size")))}


def per_layer_overrides(fields: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A heterogeneous config's per-layer overrides (dots3's per_layer_config: 64 heads, a 1024 latent rank and
    192-dim unrotated query/key parts on its sliding-window layers, 128 heads on its indexed ones) given to each small
    layer from the first full layer of its type, each shrunk size scaled as the override scales the default, and a
    head that the override makes the sum of its parts (head_dim = qk_nope_head_dim + qk_rope_head_dim) kept so."""
    table, small = fields.get("per_layer_config"), out.get("num_hidden_layers")
    full_types = fields.get("layer_types") or []
    small_types = out.get("layer_types") or full_types[:small or 0]
    if not isinstance(table, dict) or not table or not isinstance(small, int):
        return {}
    width = len(next(iter(table)))
    kept: dict[str, Any] = {}
    for i, kind in enumerate(small_types):
        source = next((j for j, t in enumerate(full_types) if t == kind), i)
        entry = table.get(str(source).zfill(width))
        if not isinstance(entry, dict):
            continue
        entry = {k: (max(1, v * out[k] // fields[k]) if isinstance(v, int) and isinstance(out.get(k), int)
                     and isinstance(fields.get(k), int) and fields[k] else v) for k, v in entry.items()}
        nope = entry.get("qk_nope_head_dim", out.get("qk_nope_head_dim"))
        rope = entry.get("qk_rope_head_dim", out.get("qk_rope_head_dim"))
        if "qk_nope_head_dim" in entry and fields.get("head_dim") == table[str(source).zfill(width)][
                "qk_nope_head_dim"] + fields.get("qk_rope_head_dim", 0):
            entry["head_dim"] = nope + rope
        kept[str(i).zfill(width)] = entry
    return {"per_layer_config": kept}


def required_defaults(base: Any, modelling_source: str) -> dict[str, Any]:
    """Fields a default config leaves unset that every forward needs, as its checkpoints set them.

    X-MOD's forward raises "Input language unknown" until a language is chosen; transformers documents
    ``set_default_language`` (which sets ``config.default_language``) as the call that chooses it: the first of
    ``config.languages``. ESM counts its positions from the padding id (RoBERTa's create_position_ids_from_input_ids),
    which its default config leaves None (a TypeError in every forward); its checkpoints use 1."""
    out: dict[str, Any] = {}
    languages = getattr(base, "languages", None)
    if hasattr(base, "default_language") and base.default_language is None and languages:
        out["default_language"] = list(languages)[0]
    if getattr(base, "pad_token_id", 0) is None and "create_position_ids_from_input_ids(" in modelling_source:
        out["pad_token_id"] = 1
    return out
