"""Planted-bug candidates for `posdiag compare`: each takes a healthy reference model and
returns a *new* model (the reference is never touched) carrying one bring-up bug.

- `interleave_qk(model)`: q/k projection rows moved into the interleaved (GPT-J / Meta) pairing
  while the rotary code stays rotate-half — the conversion permutation applied the wrong way
  (BUGS.md D: llama.cpp #2376, transformers #31766, mlx-examples #170). Still a perfectly relative
  RoPE model, so self-consistency checks pass; only a reference can tell.
- `wrong_norm_eps(model, eps)`: every normalisation layer's epsilon changed (a config field
  read under the wrong name). Not a position bug: the error is there at every position.
- `ignore_rope_scaling(model)`: the same weights in a model built from the config with its
  rope scaling block dropped (BUGS.md F: llama3/dynamic scaling never applied).
- `copy_of(model)`: an identical twin.
- `rounded_twin(model)`: the same weights rounded the other way: each float32 weight moved to a neighbouring float32
  (-1, 0 or +1 ulp at random), as a conversion through another precision or rounding mode leaves them. A real
  difference at float32's rounding, at every position alike.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval()


def rounded_twin(model: nn.Module, seed: int = 0) -> nn.Module:
    out = copy_of(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in out.parameters():
            if param.is_floating_point():
                ulp = torch.nextafter(param, torch.full_like(param, float("inf"))) - param
                param.add_(ulp * torch.randint(-1, 2, param.shape, generator=gen))
    return out


def _to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from rotate-half order [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to interleaved
    order [x_0, y_0, x_1, y_1, ...]: the inverse of the permutation HF's Llama converter applies."""
    rows = weight.shape[0]
    head_dim = rows // heads
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def interleave_qk(model: nn.Module) -> nn.Module:
    """q_proj/k_proj (weights and biases) of every attention layer permuted per head into the
    interleaved layout; per-head q/k norms (Qwen3, OLMo2) permuted the same way. Full-rotary
    Llama-style families only (a partial-rotary model would need the rotary slice alone)."""
    out = copy_of(model)
    cfg = out.config
    q_heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
    done = 0
    with torch.no_grad():
        for module in out.modules():
            if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
                continue
            for name, heads in (("q_proj", q_heads), ("k_proj", kv_heads)):
                proj = getattr(module, name)
                proj.weight.copy_(_to_interleaved(proj.weight, heads))
                if getattr(proj, "bias", None) is not None:
                    proj.bias.copy_(_to_interleaved(proj.bias, heads))
            for norm_name in ("q_norm", "k_norm"):
                norm = getattr(module, norm_name, None)
                if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.ndim == 1 \
                        and norm.weight.numel() == cfg.hidden_size // q_heads:
                    norm.weight.copy_(_to_interleaved(norm.weight, 1))
            done += 1
    if not done:
        raise RuntimeError(f"interleave_qk found no q_proj/k_proj in {type(model).__name__}")
    return out


def wrong_norm_eps(model: nn.Module, eps: float = 1e-2) -> nn.Module:
    """Every RMSNorm/LayerNorm epsilon set to `eps` (weights untouched)."""
    out = copy_of(model)
    done = 0
    for module in out.modules():
        for attr in ("variance_epsilon", "eps", "epsilon"):
            if isinstance(getattr(module, attr, None), float) and "norm" in type(module).__name__.lower():
                setattr(module, attr, eps)
                done += 1
    if not done:
        raise RuntimeError(f"wrong_norm_eps found no norm layer in {type(model).__name__}")
    return out


def ignore_rope_scaling(model: nn.Module) -> nn.Module:
    """The reference's weights in a model built from its config with rope_parameters reduced
    to the default type (rope_theta kept): the port never applied the scaling block."""
    import transformers

    cfg = copy.deepcopy(model.config)
    params = dict(cfg.rope_parameters)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": params["rope_theta"],
                           **({"partial_rotary_factor": params["partial_rotary_factor"]}
                              if "partial_rotary_factor" in params else {})}
    out = type(model)(cfg)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    if [k for k in missing if "inv_freq" not in k] or unexpected:
        raise RuntimeError(f"weights did not transfer: missing {missing}, unexpected {unexpected}")
    del transformers
    return out.to(next(model.parameters()).dtype).eval()
