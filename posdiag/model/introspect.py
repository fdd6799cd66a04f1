"""Which sequence mixers are not attention — found structurally, so the checks can say what they can still judge.

posdiag's order checks rest on one premise: every sequence mixer is attention, whose output depends only on
(tokens, position ids, mask). Then a *consistent* permutation (tokens, mask and position ids permuted together)
reproduces P f(x) exactly and serves as the rounding floor. Recurrent, linear-attention and convolutional mixers
(Mamba / Mamba2 and their hybrids Jamba, Bamba, Falcon-H1, Zamba2, GraniteMoeHybrid; MiniMax lightning attention;
Qwen3-Next / OLMo-hybrid gated delta nets; Kimi delta attention; LFM2 short convolutions; RWKV; RG-LRU) read order
through the recurrence itself, so no consistent permutation exists: measured on a healthy tiny MiniMax, the
"consistent" run differs from P f(x) by 0.0475 (3e5x the rounding floor).

Found from the modules, not from family names, so unknown checkpoints are covered:
- a module that owns a depthwise Conv1d (groups == channels: the causal short convolution of Mamba, gated delta
  nets and LFM2 — never part of a text attention block);
- a module that owns a recurrence parameter or buffer (`A_log`/`dt_bias` of Mamba and delta nets, `slope_rate`
  of lightning attention, RWKV's `time_decay`, RG-LRU's `recurrent_param`);
- a class name naming such a mixer (Mamba, LightningAttention, GatedDeltaNet, ShortConv, Rwkv, Rglru, ...);
- failing those, config layer types that are not attention ("linear_attention", "mamba", "conv", "hybrid").
The module that owns the state is named (JambaMambaMixer, not the JambaMambaDecoderLayer around it); of nested
owners only the outermost.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from posdiag.model.kinds import PositionKind

# Class names of known non-attention sequence mixers (transformers 5.24: MiniMaxLightningAttention,
# Qwen3NextGatedDeltaNet, JambaMambaMixer, Lfm2ShortConv, GraniteMoeHybridMambaLayer, Zamba2MambaMixer,
# NemotronHMamba2Mixer, KimiLinearDeltaAttention, RwkvSelfAttention, RecurrentGemmaRglru, ...). Bare
# "LinearAttention" is left out on purpose: KimiLinearAttention is Kimi-Linear's full (MLA) attention.
_NAME = re.compile(r"Mamba|LightningAttention|GatedDeltaNet|DeltaNet|DeltaAttention|ShortConv|Rwkv|RWKV|Rglru"
                   r"|RecurrentBlock|[msx]LSTM|Hyena|Retention|Ssm(?![a-z])|SSM")
# Classes of a recurrent family that are not its mixer (MambaRMSNorm, RwkvFeedForward, MambaModel...).
_NOT_MIXER = re.compile(r"(Norm|NormGated|MLP|Mlp|FeedForward|Embeddings?|Model|ForCausalLM|Output|PreTrainedModel)$")
# Parameters / buffers that only a recurrence owns.
_STATE = ("A_log", "dt_bias", "slope_rate", "time_decay", "time_first", "recurrent_param")
# Config layer types that are attention; anything else in a layer-type list is taken as a recurrent mixer.
# indexed_attention: DeepSeek sparse attention (an indexer picks the keys each query attends); reference_sliding:
# unlimited_ocr's window over the tokens after the prefill. Both are softmax attention over rotated q/k.
_ATTENTION_TYPES = re.compile(r"^(full|sliding|chunked|global|local|sparse|compressed\w*|heavily\w*|indexed"
                              r"|reference_sliding)?_?attention$"
                              r"|^(global|local|full|sliding|attn)$")
_ATTENTION_CLASS = re.compile(r"(Attention|Attn)$")
_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")

_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _owns_state(module: torch.nn.Module) -> bool:
    """The module itself holds a recurrence parameter/buffer or a depthwise (short, causal) convolution."""
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if any(n in _STATE for n in own):
        return True
    return any(isinstance(c, torch.nn.Conv1d) and c.groups > 1 and c.groups == c.in_channels
               for c in module.children())


def _config_types(config: Any) -> list[str]:
    """Layer types from the config that are not attention (e.g. "linear_attention", "mamba", "conv")."""
    for cfg in (config, getattr(config, "text_config", None)):
        for field in _LAYER_TYPE_FIELDS:
            try:
                types = getattr(cfg, field, None)
            except Exception:  # computed properties can raise on partial configs
                types = None
            if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
                return sorted({t for t in types if not _ATTENTION_TYPES.match(t)})
    return []


def recurrent_mixers(model: torch.nn.Module) -> list[str]:
    """Class names of the model's non-attention sequence mixers (empty for pure attention); cached per model."""
    cached = _CACHE.get(model)
    if cached is not None:
        return list(cached)
    modules = dict(model.named_modules())
    owners = [n for n, m in modules.items() if _owns_state(m)]
    # A class named like a mixer counts when no state owner sits inside it (a decoder layer named
    # "...MambaDecoderLayer" wraps the mixer that owns the state: the mixer is the one to name).
    named = [n for n, m in modules.items() if _NAME.search(type(m).__name__) and not _NOT_MIXER.search(type(m).__name__)
             and any(isinstance(c, torch.nn.Linear) for c in m.modules())
             and not any(o.startswith(n + ".") for o in owners)]
    hits = sorted(set(owners) | set(named))
    outer = [n for n in hits if not any(n.startswith(h + ".") for h in hits if h)]
    found: list[str] = []
    for n in outer:
        cls = type(modules[n]).__name__
        if cls not in found:
            found.append(cls)
    if not found:
        types = _config_types(getattr(model, "config", None))
        found = [f"layer type '{t}'" for t in types]
    _CACHE[model] = tuple(found)
    return found


def attention_free(model: torch.nn.Module) -> bool:
    """Recurrent mixers and no attention module at all (Mamba, Mamba2): no layer reads an attention mask."""
    mixers = set(recurrent_mixers(model))
    return bool(mixers) and not any(_ATTENTION_CLASS.search(type(m).__name__) and type(m).__name__ not in mixers
                                    for m in model.modules())


def recurrent_reason(subject: Any) -> str | None:
    """The skip reason for checks that need a consistent permutation, or None for pure attention models. Searched in
    the language model only: a tower's convolutions (VibeVoice-ASR's acoustic tokenizer) never see the text."""
    names = recurrent_mixers(subject.language_model)
    if not names:
        return None
    return (f"{subject.family.name} has recurrent sequence mixers ({', '.join(names)}): order enters through the "
            f"recurrence, so a consistent permutation cannot be built")


def mixing_reason(subject: Any) -> str | None:
    """Why no consistent permutation exists: recurrent mixers (recurrent_reason), or a family whose tokens are mixed
    by something other than attention (`Family.token_mixing`, FNet's Fourier transform); None for attention."""
    mixing = subject.family.token_mixing
    if recurrent_mixers(subject.language_model) or not mixing:
        return recurrent_reason(subject)
    return (f"{subject.family.name} mixes tokens by {mixing}, not by attention alone: a consistent permutation is "
            "not expected to reproduce P f(x)")


def takes_attention_mask(subject: Any, stack: str) -> bool:
    """Whether the call a stack runs through names an attention mask among its arguments. FNet's forward has none
    (its **kwargs swallow one unread), CPM-Ant's is a dummy (`Family.mask_form` "none"); a `module:factory` model is
    taken at its word (the forward protocol)."""
    import inspect

    if not subject.is_hf:
        return True
    if subject.family.mask_form == "none":  # a family row says its mask argument is unread (CPM-Ant)
        return False
    if subject.kind == "seq2seq":
        fn, name = ((subject.model.get_encoder().forward, "attention_mask") if stack == "encoder"
                    else (subject.model.forward, "decoder_attention_mask"))
    else:
        fn, name = subject.model.forward, "attention_mask"
    return name in inspect.signature(fn).parameters


__all__ = ["recurrent_mixers", "recurrent_reason", "mixing_reason", "takes_attention_mask", "attention_free"]


def detect_position_kind(model: torch.nn.Module) -> PositionKind:
    """Best effort for families not in the table: look at module and parameter names."""
    names = [n for n, _ in model.named_modules()]
    buffers = [n for n, _ in model.named_buffers()]
    params = [n for n, _ in model.named_parameters()]
    if any("rotary" in n.lower() or n.endswith("inv_freq") for n in names + buffers):
        return PositionKind.ROPE
    if any("alibi" in n.lower() for n in names + buffers):
        return PositionKind.ALIBI
    if any("relative_attention_bias" in n for n in params):
        return PositionKind.RELATIVE_BIAS
    tables = ("position_embeddings", "positions_embed", "wpe", "embed_positions", "pos_emb")
    if any(k in n for n in params for k in tables):
        return PositionKind.LEARNED
    if any(n.split(".")[-1] == "pos_encoding" for n in buffers):  # CTRL: a sinusoidal table kept as a buffer
        return PositionKind.SINUSOIDAL
    return PositionKind.NONE
