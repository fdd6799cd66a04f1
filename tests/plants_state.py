"""Planted state bugs for the `state` check, each with its healthy twin, on tiny zoo models in memory.

- sticky_dynamic: a dynamic-NTK rotary that grows on a long input and never shrinks back (transformers #46624: the
  cached length went to a stray attribute, so the reset never fired). Twin: stock dynamic NTK, which resets.
- kept_offset: positions counted by the model across calls, not reset at a new prompt (ExecuTorch #15286's stale
  position; Qwen2-VL's rope_deltas of a previous call reused, #36013). Twin: reset at every prefill.
- advance_by_one: the position counter advanced by 1 per call whatever the number of tokens fed (transformers #30068:
  assisted decoding moved cache_position by 1, not by the accepted candidates). Twin: advanced by the tokens fed.
- kept_mask: the first call's attention mask reused for later calls (padding of one batch leaking into the next).
  Twin: the same hook, keeping the mask but using the call's own.
- unbounded_sliding_update: a sliding-window cache that, recording the past for assisted decoding, returns every key
  it holds while the mask is sized for the window (#48280). Twin: the stock update.
- self_only: attention that returns each token's own value (tokens never interact; the explicit mask is ignored).
"""

from __future__ import annotations

from typing import Any

import torch

from posdiag.testing import zoo


def dynamic_model(family: str, *, sticky: bool) -> torch.nn.Module:
    """A tiny model whose config asks for dynamic-NTK RoPE; `sticky`: the reset to the original frequencies never
    fires (its threshold attribute written to 0, as when the length went to a stray attribute)."""
    cfg = zoo.tiny_config(family, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = _built(cfg)
    rotaries = [m for m in model.modules() if hasattr(m, "original_max_seq_len")]
    assert rotaries, f"{family}: no dynamic rotary module"
    if sticky:
        for module in rotaries:
            module.original_max_seq_len = 0
    return model


def _built(cfg: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _cache_length(kwargs: dict) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return 0 if cache is None else int(cache.get_seq_length())


def kept_offset(model: torch.nn.Module, *, reset: bool) -> torch.nn.Module:
    """The model numbers a new prompt's positions from an offset it keeps (`rope_deltas`, as Qwen2-VL keeps the
    offset of its last prompt) and the cached tokens after that. `reset`: the offset is worked out anew for every
    prompt (a call on an empty cache: 0 for text); else the one of the first prompt's end stays (#36013)."""
    model.rope_deltas = None

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        past, n = _cache_length(kwargs), ids.shape[1]
        if past == 0 and (reset or module.rope_deltas is None):
            module.rope_deltas = 0
        start = module.rope_deltas + past
        if past == 0 and not reset:
            module.rope_deltas = n  # stale from here on: the next prompt starts where this one ended
        kwargs["position_ids"] = (start + torch.arange(n, device=ids.device))[None].expand(ids.shape[0], -1)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def counted_positions(model: torch.nn.Module, *, by_tokens: bool) -> torch.nn.Module:
    """The model keeps a position counter per cache (`next_position`, set at each prefill).
    `by_tokens`: positions follow the cache's length (the healthy twin: the default positions, the counter only
    kept); else the counter, moved by 1 per cached call, as assisted decoding's cache position was (#30068): right
    for greedy decoding, wrong once a call feeds several candidates."""
    model.next_position = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past, n, key = _cache_length(kwargs), ids.shape[1], id(cache)
        start = module.next_position.get(key, past) if past and not by_tokens else past
        kwargs["position_ids"] = (start + torch.arange(n, device=ids.device))[None].expand(ids.shape[0], -1)
        module.next_position = {**module.next_position, key: start + (n if by_tokens or past == 0 else 1)}
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def kept_mask(model: torch.nn.Module, *, reuse: bool) -> torch.nn.Module:
    """The first call's attention mask kept (`kept_mask`); `reuse`: later calls of the same batch size run with it
    (cropped or extended on the left to their length) instead of their own."""
    model.kept_mask = None

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return args, kwargs
        kept = module.kept_mask
        if kept is None or kept.shape[0] != mask.shape[0]:
            module.kept_mask = mask.clone()
        elif reuse:
            t = mask.shape[1]
            kwargs["attention_mask"] = kept[:, -t:] if t <= kept.shape[1] else torch.cat(
                [torch.ones(mask.shape[0], t - kept.shape[1], dtype=mask.dtype), kept], 1)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def self_only(model: torch.nn.Module) -> torch.nn.Module:
    """Every attention layer (q/k/v/o projections) returns each token's own value, projected: no other token ever
    enters, no score is computed, the mask is never read (remote code that drops the attention product)."""
    for module in [m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj")]:
        def forward(hidden_states: torch.Tensor, *args: Any, attention: torch.nn.Module = module,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
            value = attention.v_proj(hidden_states)  # [B, T, kv heads * D]
            b, t, _ = value.shape
            d = attention.head_dim
            kv, heads = value.shape[-1] // d, attention.o_proj.in_features // d
            value = value.view(b, t, kv, d).repeat_interleave(heads // kv, dim=2).reshape(b, t, heads * d)
            return attention.o_proj(value), None

        module.forward = forward
    return model


def demo_sticky_dynamic() -> torch.nn.Module:
    """For docs/checks.md (state): `posdiag check tests.plants_state:demo_sticky_dynamic --only state`."""
    return dynamic_model("llama", sticky=True)


def demo_self_only() -> torch.nn.Module:
    """For docs/checks.md (shuffle): `posdiag check tests.plants_state:demo_self_only --only shuffle,positions`."""
    return self_only(zoo.tiny_model("llama"))


def unbounded_sliding_update(original: Any) -> Any:
    """DynamicSlidingWindowLayer.update that, once it records the past for cropping (assisted decoding), returns
    every key it holds, not the window plus the new tokens its mask sizes are advertised for (#48280)."""
    def update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = original(self, key_states, value_states, *args, **kwargs)
        return (self.keys, self.values) if self.record_past else (keys, values)

    return update
