"""Planted multimodal-RoPE bugs on tiny Qwen2-VL / Qwen3-VL, each invisible to text positions (three equal
streams) and visible once the t/h/w streams differ. Plants mutate one instance only (instance attributes, or
`__class__` swapped to a subclass defined here), never a transformers module."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
from transformers.models.qwen3_vl import modeling_qwen3_vl as q3

from posdiag.testing.multimodal import tiny_multimodal

# Looked up by the rope check's capture in this module's globals (the planted attention's forward lives here).
eager_attention_forward = q2.eager_attention_forward


def healthy(model_type: str) -> nn.Module:
    return tiny_multimodal(model_type)


def _text_rotary(model: nn.Module) -> nn.Module:
    return model.model.language_model.rotary_emb


class _ChunkedOnQwen3(q3.Qwen3VLTextRotaryEmbedding):
    """Qwen3-VL's frequencies recomposed in Qwen2-VL's chunked layout (the config's layout is interleaved)."""

    def recomposition_frequencies(self, freq):
        freq = torch.cat([m[i % 3] for i, m in enumerate(freq.split(self.mrope_section, dim=-1))], dim=-1)
        return torch.cat((freq, freq), dim=-1)


class _InterleavedOnQwen2(q2.Qwen2VLRotaryEmbedding):
    """Qwen2-VL's frequencies recomposed in Qwen3-VL's interleaved layout (the config's layout is chunked)."""

    def recomposition_frequencies(self, freq):
        out = freq[0].clone()
        for stream, offset in ((1, 1), (2, 2)):
            idx = slice(offset, self.mrope_section[stream] * 3, 3)
            out[..., idx] = freq[stream, ..., idx]
        return torch.cat((out, out), dim=-1)


def wrong_layout(model_type: str) -> nn.Module:
    model = healthy(model_type)
    rotary = _text_rotary(model)
    rotary.__class__ = _ChunkedOnQwen3 if model_type == "qwen3_vl" else _InterleavedOnQwen2
    return model


def wrong_sections(model_type: str) -> nn.Module:
    """The rotary module splits the pairs [2, 4, 2] where the config says [4, 2, 2]."""
    model = healthy(model_type)
    _text_rotary(model).mrope_section = [2, 4, 2]
    return model


class _StashingRotary(q2.Qwen2VLRotaryEmbedding):
    """Also computes the rotation with the h and w streams exchanged, for the planted key rotation."""

    def forward(self, x, position_ids):
        swapped = position_ids.expand(3, -1, -1)[[0, 2, 1]]
        self.swapped = super().forward(x, swapped)
        return super().forward(x, position_ids)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + q2.rotate_half(x) * sin


class _KeySectionsSwappedAttention(q2.Qwen2VLAttention):
    """q rotated by the config's sections, k with the h and w sections exchanged."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, position_embeddings=None,
                **kwargs):
        bsz, q_len, _ = hidden_states.size()
        shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos_k, sin_k = self.planted_rotary.swapped
        q, k = _rotate(q, cos, sin), _rotate(k, cos_k, sin_k)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = eager_attention_forward(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(bsz, q_len, -1).contiguous()), weights


def sections_swapped_between_q_and_k() -> nn.Module:
    model = healthy("qwen2_vl")
    rotary = _text_rotary(model)
    rotary.__class__ = _StashingRotary
    for layer in model.model.language_model.layers:
        layer.self_attn.__class__ = _KeySectionsSwappedAttention
        layer.self_attn.planted_rotary = rotary
    return model


# ------------------------------------------------------------- decode positions after an image (cache, generate)
def with_image(model_type: str) -> nn.Module:
    """The healthy twin of the decode plants: image placeholder ids inside the small vocabulary."""
    return tiny_multimodal(model_type, image_tokens_in_vocab=True)


def _planted_deltas(model: nn.Module, deltas) -> nn.Module:
    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(input_ids, *args, **kwargs):
        positions, right = original(input_ids, *args, **kwargs)
        return positions, deltas(right, input_ids)

    inner.get_rope_index = get_rope_index  # an instance attribute: the class is untouched
    return model


def decode_ignoring_rope_deltas(model_type: str) -> nn.Module:
    """Stored rope_deltas of 0: a manual decode loop numbers new tokens by the token count."""
    return _planted_deltas(with_image(model_type), lambda d, ids: torch.zeros_like(d))


def decode_restarting_at_zero(model_type: str) -> nn.Module:
    """Stored rope_deltas of -tokens: the first decoded token sits at position 0 again."""
    return _planted_deltas(with_image(model_type), lambda d, ids: torch.full_like(d, -ids.shape[1]))


def _planted_generate(model: nn.Module, rows) -> nn.Module:
    original = model._update_model_kwargs_for_generation

    def update(*args, **kwargs):
        out = original(*args, **kwargs)
        pos = out.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.ndim == 3 and pos.shape[0] == 4:
            pos = pos.clone()
            pos[1:, :, -1] = rows(pos)
            out["position_ids"] = pos
        return out

    model._update_model_kwargs_for_generation = update
    return model


def generate_ignoring_rope_deltas(model_type: str) -> nn.Module:
    """generate() numbers each new token's t/h/w by its text position (the token count): rope_deltas dropped."""
    return _planted_generate(with_image(model_type), lambda pos: pos[0, :, -1])


def generate_restarting_at_zero(model_type: str) -> nn.Module:
    """generate() restarts the t/h/w streams at 0 after the prompt."""
    return _planted_generate(with_image(model_type), lambda pos: pos[0, :, -1] - pos[0, :, -1].min())


def _wrapped_forward(model: nn.Module, refuse) -> nn.Module:
    """The model's forward, raising where refuse(model, kwargs) names an exception (an instance attribute)."""
    original = model.forward

    def forward(*args, **kwargs):
        exc = refuse(model, kwargs)
        if exc is not None:
            raise exc
        return original(*args, **kwargs)

    model.forward = forward
    return model


def decode_crashing_after_an_image(model_type: str) -> nn.Module:
    """A cached one-token step after an image prompt (stored rope_deltas non-zero) raises; text decoding runs."""
    def refuse(model, kwargs):
        ids, deltas = kwargs.get("input_ids"), getattr(model.model, "rope_deltas", None)
        after_image = isinstance(deltas, torch.Tensor) and bool((deltas != 0).any())
        if ids is not None and ids.shape[1] == 1 and after_image:
            return IndexError("planted: decode step after an image")
        return None
    return _wrapped_forward(with_image(model_type), refuse)


def refusing_pixel_values(model_type: str) -> nn.Module:
    """Every forward given pixel values raises: posdiag's image prompt is not an input this model takes."""
    return _wrapped_forward(with_image(model_type), lambda model, kwargs: ValueError("planted: no pixel values")
                            if kwargs.get("pixel_values") is not None else None)
