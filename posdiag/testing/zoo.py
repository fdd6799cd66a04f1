"""Tiny models of every supported family, healthy and with positions removed.

The zoo is the test bed of posdiag: each family is built small (2 layers, 4 heads, hidden 64,
vocab 256) from a config alone, so the checks can be exercised on CPU in milliseconds, and
``remove_positions`` plants the bug the headline check must catch: a model into which position
never enters is exactly permutation-equivariant, ``f(P x, P M Pᵀ) = P f(x, M)`` (fp noise only).

Everything was measured against transformers 5.24 (see the survey notes in the families table).
Heavy imports happen inside the functions: ``import posdiag.testing.zoo`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from transformers import PretrainedConfig

FAMILIES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3",
    "gpt2", "gpt_neo", "gpt_neox", "gptj", "falcon_rope", "falcon_alibi", "opt", "bloom", "mpt",
    "stablelm", "olmo2", "cohere",
    "bert", "roberta", "distilbert", "modernbert",
    "t5", "bart", "marian",
)  # fmt: skip

POSITION_KIND: dict[str, str] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt_neox",
         "gptj", "falcon_rope", "stablelm", "olmo2", "cohere", "modernbert"),
        "rope",
    ),  # fmt: skip
    **dict.fromkeys(("gpt2", "gpt_neo", "opt", "bert", "roberta", "distilbert", "bart"), "learned"),
    "marian": "sinusoidal",
    **dict.fromkeys(("falcon_alibi", "bloom", "mpt"), "alibi"),
    "t5": "relative_bias",
}

MODEL_KIND: dict[str, str] = {
    **dict.fromkeys(FAMILIES, "causal"),
    **dict.fromkeys(("bert", "roberta", "distilbert", "modernbert"), "encoder"),
    **dict.fromkeys(("t5", "bart", "marian"), "seq2seq"),
}

SLIDING_WINDOW = 8
"""Window of every tiny sliding-window family: shorter than the 32-token probes, so it is active."""

# Shared sizes: hidden 64 = 4 heads x 16; GQA (2 kv heads) where the family has it.
_H, _L, _NH, _NKV, _FF, _V, _P = 64, 2, 4, 2, 128, 256, 128
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# family -> (config class name, kwargs). Comments say what is not obvious.
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # Mistral: one window for every layer, read from config.sliding_window by the mask builder.
    "mistral": ("MistralConfig", {"sliding_window": SLIDING_WINDOW, "head_dim": 16}),
    # Qwen2: sliding_window is set to None unless use_sliding_window; layers i >= max_window_layers
    # slide -> layer_types = [full_attention, sliding_attention].
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW,
                              "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma3 text-only; per-layer-type rope (local base 1e4 / global 1e6) -> {layer_type}_inv_freq buffers.
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    # Phi: partial rotary (rope_parameters.partial_rotary_factor 0.5 by default), no GQA in the kv sense.
    "phi": ("PhiConfig", {}),
    "phi3": ("Phi3Config", {}),
    "gpt2": ("GPT2Config", {"n_embd": _H, "n_layer": _L, "n_head": _NH, "n_positions": _P, "n_inner": _FF}),
    # GPT-Neo: layer 0 global, layer 1 local (window baked into each attention's `bias` buffer).
    "gpt_neo": ("GPTNeoConfig", {"hidden_size": _H, "num_layers": _L, "num_heads": _NH,
                                 "attention_types": [[["global", "local"], 1]], "window_size": SLIDING_WINDOW,
                                 "intermediate_size": _FF}),
    "gpt_neox": ("GPTNeoXConfig", {}),  # partial rotary 0.25
    "gptj": ("GPTJConfig", {"n_embd": _H, "n_layer": _L, "n_head": _NH, "n_positions": _P, "rotary_dim": 8,
                            "n_inner": _FF}),
    "falcon_rope": ("FalconConfig", {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": _NKV}),
    "falcon_alibi": ("FalconConfig", {"alibi": True, "new_decoder_architecture": True, "num_kv_heads": _NKV}),
    # OPT: learned table of max_position_embeddings + 2 rows (the +2 offset lives in the module).
    "opt": ("OPTConfig", {"ffn_dim": _FF, "word_embed_proj_dim": _H}),
    "bloom": ("BloomConfig", {"n_layer": _L, "n_head": _NH}),
    "mpt": ("MptConfig", {"d_model": _H, "n_heads": _NH, "n_layers": _L, "max_seq_len": _P, "expansion_ratio": 2}),
    "stablelm": ("StableLmConfig", {}),  # partial rotary 0.25
    "olmo2": ("Olmo2Config", {}),
    "cohere": ("CohereConfig", {}),
    "bert": ("BertConfig", {}),
    # RoBERTa: positions start at padding_idx + 1 = 2, so the table needs max + 2 rows.
    "roberta": ("RobertaConfig", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                  "max_position_embeddings": _P + 2}),
    "distilbert": ("DistilBertConfig", {"dim": _H, "n_layers": _L, "n_heads": _NH, "hidden_dim": _FF}),
    # ModernBERT: local layers see |q - k| <= local_attention // 2 (= 4 here); global every 2nd layer.
    "modernbert": ("ModernBertConfig", {"local_attention": SLIDING_WINDOW, "global_attn_every_n_layers": 2,
                                        "cls_token_id": 1, "sep_token_id": 2, "mask_token_id": 3}),
    "t5": ("T5Config", {"d_model": _H, "d_kv": 16, "d_ff": _FF, "num_layers": _L, "num_heads": _NH,
                        "relative_attention_num_buckets": 32, "relative_attention_max_distance": _P,
                        "pad_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 0}),
    "bart": ("BartConfig", {"d_model": _H, "encoder_layers": _L, "decoder_layers": _L,
                            "encoder_attention_heads": _NH, "decoder_attention_heads": _NH,
                            "encoder_ffn_dim": _FF, "decoder_ffn_dim": _FF, "decoder_start_token_id": 2,
                            "forced_eos_token_id": 2}),
    "marian": ("MarianConfig", {"d_model": _H, "encoder_layers": _L, "decoder_layers": _L,
                                "encoder_attention_heads": _NH, "decoder_attention_heads": _NH,
                                "encoder_ffn_dim": _FF, "decoder_ffn_dim": _FF, "decoder_vocab_size": _V,
                                "decoder_start_token_id": 0}),
}  # fmt: skip

# Keyword names used by the families that follow the Llama naming (most of them).
_LLAMA_SIZES = {
    "hidden_size": _H, "intermediate_size": _FF, "num_hidden_layers": _L, "num_attention_heads": _NH,
    "num_key_value_heads": _NKV,
}  # fmt: skip
_NO_GQA = {"gpt_neox", "bert", "roberta", "modernbert", "opt", "bloom"}
_OWN_SIZES = {"gpt2", "gpt_neo", "gptj", "mpt", "distilbert", "t5", "bart", "marian"}


def position_kind(family: str) -> str:
    """How the family injects position: rope, learned, sinusoidal, alibi or relative_bias."""
    return POSITION_KIND[_check(family)]


def model_kind(family: str) -> str:
    """causal (decoder-only), encoder (bidirectional) or seq2seq (encoder-decoder)."""
    return MODEL_KIND[_check(family)]


def _check(family: str) -> str:
    if family not in MODEL_KIND:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A very small, valid config of ``family`` (eager attention); ``overrides`` win."""
    import transformers

    cls_name, specific = _CONFIGS[_check(family)]
    kwargs: dict[str, Any] = {"vocab_size": _V}
    if family not in _OWN_SIZES:
        kwargs.update(_LLAMA_SIZES)
        if family in _NO_GQA or family.startswith("falcon"):  # Falcon names it num_kv_heads (set below)
            kwargs.pop("num_key_value_heads")
        if family in ("bloom", "opt") or family.startswith("falcon"):  # 4*hidden / ffn_dim instead
            kwargs.pop("intermediate_size")
    if family not in ("gpt2", "gptj", "mpt", "t5"):
        kwargs["max_position_embeddings"] = _P
    if family not in ("roberta", "t5"):
        kwargs.update(_IDS)
    kwargs.update(specific)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    return config


# Sizes for tiny models of model types outside FAMILIES (robustness sweeps of families posdiag has
# no quirk row for): small enough for CPU tests, every common size field set consistently.
OTHER_SIZES: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, intermediate_size=64, vocab_size=256, max_position_embeddings=256)


def tiny_model_of_type(model_type: str, *, head: str = "causal", seed: int = 0,
                       attn_implementation: str | None = None, **overrides: Any) -> nn.Module:
    """A tiny model of any transformers ``model_type`` (eval mode, transformers' default init seeded
    with ``seed``): ``AutoConfig.for_model`` with OTHER_SIZES, then ``overrides`` (family-specific
    fields). ``head``: "causal", "seq2seq" or "base"; ``attn_implementation``: None keeps
    transformers' default."""
    import torch
    import transformers

    auto = {"causal": transformers.AutoModelForCausalLM, "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "base": transformers.AutoModel}[head]
    config = transformers.AutoConfig.for_model(model_type, **{**OTHER_SIZES, **overrides})
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return auto.from_config(config, **kwargs).eval()


LLAMA4_CHUNK = 8
"""Attention chunk of the tiny Llama 4: shorter than the probes, so every probe crosses chunk boundaries."""


def tiny_llama4(*, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny Llama 4 text model (Llama4ForCausalLM, eager attention): layer 0 RoPE attending within chunks of
    LLAMA4_CHUNK tokens, layer 1 NoPE attending the whole past, with attention temperature tuning (inert below
    floor_scale - 1 = 8191: pass a small floor_scale to make it act). Not in FAMILIES: no zoo-wide sweep runs it."""
    settings = {"attention_chunk_size": LLAMA4_CHUNK, "no_rope_layers": [1, 0], **overrides}
    return tiny_model_of_type("llama4_text", seed=seed, attn_implementation="eager", **settings)


def tiny_model(
    family: str, *, seed: int = 0, init: str = "default", dtype: Any = None, **overrides: Any
) -> nn.Module:
    """Build the tiny ``family`` model (eval mode, eager attention), deterministic for ``seed``.

    Head classes: ``AutoModelForCausalLM`` for decoders, ``AutoModel`` for encoders (the base model's
    ``last_hidden_state`` is the representation), ``AutoModelForSeq2SeqLM`` for encoder-decoders.

    ``init="default"`` keeps transformers' own initialisation (std 0.02: the position signal is weak,
    a shuffle residual near 1e-2 for RoPE). ``init="strong"`` redraws, in ``named_parameters`` order
    from a generator seeded with ``seed``: every trainable embedding table (tokens, learned position
    tables, T5 relative-attention buckets) from N(0, 1), and every Linear/Conv1D weight from
    N(0, (1.5 / sqrt(fan_in))²), so attention logits are O(1) and position clearly moves the output.
    Frozen sinusoidal tables (Marian, DistilBERT with ``sinusoidal_pos_embds``), norms and biases are
    kept; padding rows stay zero; tied weights are drawn once.
    """
    import torch
    import transformers

    if init not in ("default", "strong"):
        raise ValueError(f"init must be 'default' or 'strong', not {init!r}")
    config = tiny_config(family, **overrides)
    auto = {
        "causal": transformers.AutoModelForCausalLM,
        "encoder": transformers.AutoModel,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[MODEL_KIND[family]]
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation="eager")
    if init == "strong":
        _strong_init(model, seed)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _strong_init(model: nn.Module, seed: int) -> None:
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    sinusoidal = bool(getattr(model.config, "sinusoidal_pos_embds", False))

    def fresh(param: torch.Tensor, std: float) -> None:
        if id(param) in seen or not param.requires_grad:
            return
        seen.add(id(param))
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    modules = list(model.named_modules())
    for name, module in modules:  # embeddings first, so a tied lm_head keeps the N(0, 1) table
        if isinstance(module, nn.Embedding) and "Sinusoidal" not in type(module).__name__:
            if sinusoidal and name.endswith("position_embeddings"):
                continue
            fresh(module.weight, 1.0)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
    for _, module in modules:
        if isinstance(module, nn.Linear):
            fresh(module.weight, 1.5 / module.in_features**0.5)
        elif type(module).__name__ == "Conv1D":  # GPT-2: weight is (in, out)
            fresh(module.weight, 1.5 / module.weight.shape[0] ** 0.5)


def remove_positions(model: nn.Module, family: str) -> None:
    """Mutate ``model`` in place so position no longer enters it, the way ``family`` injects it.

    - RoPE: every ``*inv_freq`` buffer (``inv_freq``, ``original_inv_freq``, and the per-layer-type
      ``{layer_type}_inv_freq`` of Gemma3/ModernBERT) is zeroed: cos = 1, sin = 0, the rotation is the
      identity (the rotary forward reads the buffer every call); dynamic/longrope modules are
      switched to ``rope_type="default"`` on the instance so they cannot recompute frequencies
      from the config at longer lengths. GPT-J keeps a precomputed
      ``embed_positions`` buffer (sin | cos halves): set to sin 0 / cos 1.
    - Learned / sinusoidal tables (``wpe``, ``embed_positions``, ``position_embeddings``): zeroed.
    - T5: every ``relative_attention_bias`` table zeroed (only block 0 of each stack has one).
    - ALiBi: Bloom and Falcon build the bias inside ``forward`` from module-level functions, so a
      forward pre-hook on each decoder layer zeroes the ``alibi`` argument (Falcon also folds
      alibi/sqrt(head_dim) into the float mask it hands the layers; the hook keeps only the blocked
      pattern, 0 / finfo.min). MPT: the instance's ``build_mpt_alibi_tensor`` returns zeros.
    Nothing global is patched: other instances are unaffected.
    """
    kind = POSITION_KIND[_check(family)]
    if kind == "rope":
        done = _identity_rotations(model)
    elif kind in ("learned", "sinusoidal"):
        done = _zero_weights(model, lambda name: name.split(".")[-1] in _POSITION_TABLES)
    elif kind == "relative_bias":
        done = _zero_weights(model, lambda name: name.endswith("relative_attention_bias"))
    elif family == "mpt":
        done = _no_mpt_alibi(model)
    else:  # bloom, falcon_alibi
        done = _hooked_alibi(model)
    if not done:
        raise RuntimeError(f"remove_positions({family!r}) found nothing to remove in {type(model).__name__}")


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def _identity_rotations(model: nn.Module) -> int:
    """Every ``*inv_freq`` buffer zeroed (its rope type frozen), GPT-J's sin | cos table set to 0 | 1."""
    import torch

    done = 0
    with torch.no_grad():
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name.endswith("inv_freq"):
                    buf.zero_()
                    done += 1
            if any(n.endswith("inv_freq") for n, _ in module.named_buffers(recurse=False)):
                _freeze_rope_type(module)
            # GPT-J's sin | cos table: on its rotary module (transformers 5.24+) or on each attention (5.17)
            if type(module).__name__ in ("GPTJRotaryEmbedding", "GPTJAttention") and \
                    isinstance(getattr(module, "embed_positions", None), torch.Tensor):
                half = module.embed_positions.shape[-1] // 2
                module.embed_positions[:, :half] = 0.0
                module.embed_positions[:, half:] = 1.0
                done += 1
    return done


def _zero_weights(model: nn.Module, chosen: Callable[[str], bool]) -> int:
    """The weight of every module whose qualified name is `chosen` zeroed (position tables, relative biases)."""
    import torch

    done = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if chosen(name):
                module.weight.zero_()
                done += 1
    return done


def _no_mpt_alibi(model: nn.Module) -> int:
    """The instance's ``build_mpt_alibi_tensor`` returns zeros."""
    import torch

    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    base = getattr(model, "transformer", base)

    def no_alibi(num_heads, sequence_length, alibi_bias_max=8, device=None):
        return torch.zeros(num_heads, 1, sequence_length, device=device)

    base.build_mpt_alibi_tensor = no_alibi
    return 1


def _hooked_alibi(model: nn.Module) -> int:
    """A forward pre-hook on each decoder layer zeroes the ``alibi`` argument (Bloom, Falcon)."""
    for layer in model.transformer.h:
        layer.register_forward_pre_hook(_zero_alibi, with_kwargs=True)
    return len(model.transformer.h)


def _freeze_rope_type(module: nn.Module) -> None:
    """Stop dynamic/longrope modules from recomputing non-zero frequencies from the config.

    ``@dynamic_rope_update`` re-derives ``inv_freq`` when the sequence outgrows
    ``max_seq_len_cached`` (dynamic) or past ``original_max_position_embeddings`` (longrope, whose
    ``long_inv_freq`` attribute is rebuilt from the config when missing). The wrapper dispatches on
    the instance's ``rope_type`` (a dict per layer type for Gemma3/ModernBERT), so calling them
    "default" on this instance keeps the zeroed buffers; ``attention_scaling`` is left as it was.
    """
    rope_type = getattr(module, "rope_type", None)
    frozen = lambda t: "default" if ("dynamic" in t or t == "longrope") else t  # noqa: E731
    if isinstance(rope_type, str):
        module.rope_type = frozen(rope_type)
    elif isinstance(rope_type, dict):
        module.rope_type = {k: frozen(v) for k, v in rope_type.items()}
    for attr in [a for a in vars(module) if a.endswith("long_inv_freq")]:
        setattr(module, attr, None)


def _zero_alibi(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    import torch

    alibi = kwargs.get("alibi")
    if alibi is not None:
        kwargs["alibi"] = torch.zeros_like(alibi)
    mask = kwargs.get("attention_mask")
    if type(module).__name__ == "FalconDecoderLayer" and mask is not None and mask.is_floating_point():
        # FalconModel.forward folds alibi / sqrt(head_dim) into the mask it passes down (from transformers 5.25 the
        # only place the blocks get it); keep only blocking.
        kwargs["attention_mask"] = torch.where(mask < -1, torch.finfo(mask.dtype).min, 0.0).to(mask.dtype)
    return args, kwargs
