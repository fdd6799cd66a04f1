"""Precision as run: bugs that exist only in the dtype a model runs in, and their healthy twins.

transformers PR #29285's class: the rotary angles computed from position ids cast to the dtype of the hidden states.
In float32 (and float64) the cast changes nothing; in bfloat16 every position above 256 rounds (to a multiple of
2 up to 512, of 4 up to 1024, ...), so tokens far into the context get a neighbour's angle. A run upcast to
float32 never sees it; the model as users run it in bfloat16 does.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from posdiag.testing import zoo

CONTEXT = 4096  # long enough that the probes reach positions bfloat16 cannot hold exactly


def healthy(family: str = "llama") -> nn.Module:
    """A tiny strongly initialised model with a 4096-token context: transformers' own rotary, angles in float32."""
    return zoo.tiny_model(family, init="strong", max_position_embeddings=CONTEXT)


def positions_in_run_dtype(family: str = "llama") -> nn.Module:
    """The rotary module casts position ids to the hidden states' dtype before multiplying by the frequencies."""
    model = healthy(family)
    rotary = next(m for m in model.modules() if "Rotary" in type(m).__name__)

    def forward(self, x, position_ids, *args, **kwargs):
        positions = position_ids.to(x.dtype).float()  # the plant: exact in float32, rounded in bfloat16
        freqs = positions[..., None] * self.inv_freq.float()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    rotary.forward = types.MethodType(forward, rotary)
    return model


def llama() -> nn.Module:
    return healthy("llama")


def llama_positions_in_run_dtype() -> nn.Module:
    return positions_in_run_dtype("llama")


def qwen2() -> nn.Module:
    return healthy("qwen2")


def qwen2_positions_in_run_dtype() -> nn.Module:
    return positions_in_run_dtype("qwen2")


def gemma() -> nn.Module:
    return healthy("gemma")


def gemma_positions_in_run_dtype() -> nn.Module:
    return positions_in_run_dtype("gemma")
