"""Planted RoPE bugs (BUGS.md C, D, E, F, G) and their healthy twins, on tiny zoo models.

Every builder returns a model in eval mode. Plants mutate one instance only (buffers, instance
attributes, or `__class__` swapped to a subclass defined here), never a transformers module.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn
from transformers.models.llama import modeling_llama as ml

from posdiag.testing import zoo

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
LONG_SHORT = {"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
              "long_factor": [1.0, 1.2, 1.6, 2.5, 4.0, 6.0, 8.0, 10.0]}

# name -> (family, config overrides); head_dim 16 -> 8 pairs, declared context 128.
HEALTHY = {
    "theta": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "yarn": ("llama", {"rope_parameters": YARN}),
    "yarn_qwen2": ("qwen2", {"rope_parameters": YARN}),
    "yarn_mistral": ("mistral", {"rope_parameters": YARN}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32}}),
    "dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "longrope": ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 32, **LONG_SHORT},
                          "original_max_position_embeddings": 32}),
    "local_global": ("gemma3", {}),
    "partial": ("phi", {}),
    "partial_neox": ("gpt_neox", {}),
}


def healthy(name: str, **kw) -> nn.Module:
    family, overrides = HEALTHY[name]
    return zoo.tiny_model(family, **copy.deepcopy(overrides), **kw)


def _rotary(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if "Rotary" in type(m).__name__)


def _set_freqs(module: nn.Module, freqs: torch.Tensor, prefix: str = "") -> None:
    with torch.no_grad():
        for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
            getattr(module, name).copy_(freqs.to(getattr(module, name).dtype))


def _default_freqs(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


# ------------------------------------------------------------------ F: theta / scaling ignored
def theta_ignored() -> nn.Module:
    """candle PR #3746: rope_theta never passed through, base 10000 used."""
    model = healthy("theta")
    _set_freqs(_rotary(model), _default_freqs(10000.0, 16))
    return model


def linear_ignored() -> nn.Module:
    """Linear (PI) scaling factor never applied."""
    model = healthy("linear")
    _set_freqs(_rotary(model), _default_freqs(10000.0, 16))
    return model


def yarn_ignored() -> nn.Module:
    """YaRN block ignored: unscaled frequencies and no attention factor."""
    model = healthy("yarn")
    rot = _rotary(model)
    _set_freqs(rot, _default_freqs(10000.0, 16))
    rot.attention_scaling = 1.0
    return model


def yarn_mscale_ignored() -> nn.Module:
    """vLLM #48621: YaRN frequencies right, attention factor (mscale) dropped."""
    model = healthy("yarn")
    _rotary(model).attention_scaling = 1.0
    return model


class _YarnPort:
    """A port's attention (vLLM #48621, exllamav3 #259): cos/sin rebuilt from the rotary module's inv_freq and
    multiplied by `port_scale` (the bug: 1, or the factor twice) instead of the module's tables, which stay
    correct. `port_apply`: rotate through apply_rotary_pos_emb, else inline. Mixed into the family's class."""

    port_scale, port_apply = 1.0, False

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                position_ids=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        angles = position_ids[..., None].float() * self.port_rotary.inv_freq.float()
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = (emb.cos() * self.port_scale).to(q.dtype), (emb.sin() * self.port_scale).to(q.dtype)
        if self.port_apply:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        else:
            q, k = _half(q, cos[:, None], sin[:, None]), _half(k, cos[:, None], sin[:, None])
        out, weights = eager_attention_forward(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                               sliding_window=getattr(self, "sliding_window", None), **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


_PORT_CLASSES: dict[type, type] = {}


def yarn_port(family: str, factor_power: int, apply: bool, dtype=None) -> nn.Module:
    """YaRN model whose attention is a port applying the attention factor `factor_power` times (0: dropped,
    1: healthy, 2: twice); rotary module and tables untouched."""
    model = healthy("yarn" if family == "llama" else f"yarn_{family}", dtype=dtype)
    rot = _rotary(model)
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith("Attention") and hasattr(module, "q_proj"):
            module.__class__ = _PORT_CLASSES.setdefault(cls, type(f"YarnPort{cls.__name__}", (_YarnPort, cls), {}))
            module.port_scale, module.port_apply = rot.attention_scaling ** factor_power, apply
            module.__dict__["port_rotary"] = rot  # a reference, not a submodule
    return model


def llama3_wrong_factor() -> nn.Module:
    """llama-models #241: llama3 scaling with the wrong factor (here 2 instead of 8)."""
    model = healthy("llama3")
    cfg = zoo.tiny_config("llama", **copy.deepcopy(HEALTHY["llama3"][1]))
    cfg.rope_parameters["factor"] = 2.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    freqs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    _set_freqs(_rotary(model), freqs)
    return model


def dynamic_static() -> nn.Module:
    """vLLM #5093: 'dynamic' NTK effectively static (never recomputed past the declared context)."""
    model = healthy("dynamic")
    _rotary(model).rope_type = "default"
    return model


def longrope_no_switch() -> nn.Module:
    """transformers PR #33129 and ports: Phi-3 longrope never switches to the long factors."""
    model = healthy("longrope")
    _rotary(model).rope_type = "default"
    return model


def gemma3_local_uses_global_base() -> nn.Module:
    """llama.cpp #12357 analogue: sliding-window layers rotated with the global base."""
    model = healthy("local_global")
    rot = _rotary(model)
    _set_freqs(rot, rot.full_attention_inv_freq.clone(), prefix="sliding_attention_")
    return model


# ------------------------------------------------------------------ C: half-precision angles
def bf16_angles() -> nn.Module:
    """gpt-neox #1003 / transformers #25681: angles computed in bf16 while the model runs fp32."""
    model = healthy("theta")
    rot = _rotary(model)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.bfloat16) * self.inv_freq.to(torch.bfloat16)
        emb = torch.cat((freqs, freqs), dim=-1).float()
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    rot.forward = types.MethodType(forward, rot)
    return model


# ------------------------------------------------------------------ D: q/k rotation mistakes
def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _half(x, cos, sin):
    return x * cos + ml.rotate_half(x) * sin


def _interleaved(x, cos, sin):
    half = cos.shape[-1] // 2
    c = torch.repeat_interleave(cos[..., :half], 2, dim=-1)
    s = torch.repeat_interleave(sin[..., :half], 2, dim=-1)
    return x * c + _rotate_every_two(x) * s


def _identity(x, cos, sin):
    return x


class _PlantedLlamaAttention(ml.LlamaAttention):
    """A port's attention: same weights, its own rotation of q and k (set per instance)."""

    rotate_q = staticmethod(_half)
    rotate_k = staticmethod(_half)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = self.rotate_q(q, cos, sin), self.rotate_k(k, cos, sin)
        out, weights = eager_attention_forward(self, q, k, v, attention_mask, dropout=0.0,
                                               scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


eager_attention_forward = ml.eager_attention_forward
apply_rotary_pos_emb = ml.apply_rotary_pos_emb


def _planted_attention(rotate_q, rotate_k) -> nn.Module:
    model = healthy("theta")
    for module in model.modules():
        if isinstance(module, ml.LlamaAttention):
            module.__class__ = _PlantedLlamaAttention
            module.rotate_q, module.rotate_k = rotate_q, rotate_k
    return model


def faithful_port() -> nn.Module:
    """The healthy twin of the attention plants: the port's own forward, rotating correctly."""
    return _planted_attention(_half, _half)


def keys_not_rotated() -> nn.Module:
    """q rotated, k never rotated."""
    return _planted_attention(_half, _identity)


def q_half_k_interleaved() -> nn.Module:
    """mlx-examples #170 style: q rotate-half, k interleaved."""
    return _planted_attention(_half, _interleaved)


# ------------------------------------------------------------------ G: uninitialised frequency buffer
class _CustomRotary(nn.Module):
    """A port's own rotary class the loader does not recognise: its buffer keeps whatever memory held."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def uninitialised_buffer(garbage: str = "bits") -> nn.Module:
    """transformers #34234: inv_freq left as torch.empty memory. Deterministic stand-ins for that memory:
    "bits" (arbitrary float bit patterns, as torch.empty returns), "zeros" (freshly mapped pages)."""
    model = healthy("theta")
    if garbage == "zeros":
        buf = torch.zeros(8)
    else:
        buf = torch.tensor([3, 0x7F7FFFFF, 12345, 0x3F800000, 0x00800000, 0x4B000000, 777, 0x1],
                           dtype=torch.int32).view(torch.float32).clone()
    model.model.rotary_emb = _CustomRotary(buf)
    return model


def custom_rotary_initialised() -> nn.Module:
    """Healthy twin: the same custom class with its buffer computed from the config."""
    model = healthy("theta")
    model.model.rotary_emb = _CustomRotary(_default_freqs(500000.0, 16).float())
    return model


# ------------------------------------------------------------------ E: partial rotary factor dropped
def partial_dropped(name: str = "partial") -> nn.Module:
    """partial_rotary_factor dropped: the whole head rotates, frequencies from head_dim."""
    model = healthy(name)
    rot = _rotary(model)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    theta = rot.config.rope_parameters["rope_theta"]
    rot.inv_freq = _default_freqs(theta, head_dim).float()
    rot.original_inv_freq = rot.inv_freq.clone()
    for module in model.modules():
        if hasattr(module, "rotary_ndims"):
            module.rotary_ndims = head_dim
    return model


PLANTED = {
    "theta_ignored": theta_ignored,
    "linear_ignored": linear_ignored,
    "yarn_ignored": yarn_ignored,
    "yarn_mscale_ignored": yarn_mscale_ignored,
    "llama3_wrong_factor": llama3_wrong_factor,
    "dynamic_static": dynamic_static,
    "longrope_no_switch": longrope_no_switch,
    "gemma3_local_uses_global_base": gemma3_local_uses_global_base,
    "bf16_angles": bf16_angles,
    "keys_not_rotated": keys_not_rotated,
    "q_half_k_interleaved": q_half_k_interleaved,
    "uninitialised_bits": lambda: uninitialised_buffer("bits"),
    "uninitialised_zeros": lambda: uninitialised_buffer("zeros"),
    "partial_dropped_phi": lambda: partial_dropped("partial"),
    "partial_dropped_neox": lambda: partial_dropped("partial_neox"),
    "yarn_port_drops_factor_llama": lambda: yarn_port("llama", 0, apply=False),
    "yarn_port_drops_factor_qwen2": lambda: yarn_port("qwen2", 0, apply=True),
    "yarn_port_drops_factor_mistral": lambda: yarn_port("mistral", 0, apply=False),
    "yarn_port_doubles_factor_llama": lambda: yarn_port("llama", 2, apply=True),
    "yarn_port_doubles_factor_qwen2": lambda: yarn_port("qwen2", 2, apply=False),
}

TWINS = {
    "theta": lambda: healthy("theta"),
    "linear": lambda: healthy("linear"),
    "yarn": lambda: healthy("yarn"),
    "yarn_qwen2": lambda: healthy("yarn_qwen2"),
    "yarn_mistral": lambda: healthy("yarn_mistral"),
    "yarn_port_keeps_factor_llama": lambda: yarn_port("llama", 1, apply=False),
    "yarn_port_keeps_factor_qwen2": lambda: yarn_port("qwen2", 1, apply=True),
    "llama3": lambda: healthy("llama3"),
    "dynamic": lambda: healthy("dynamic"),
    "longrope": lambda: healthy("longrope"),
    "local_global": lambda: healthy("local_global"),
    "partial": lambda: healthy("partial"),
    "partial_neox": lambda: healthy("partial_neox"),
    "faithful_port": faithful_port,
    "custom_rotary_initialised": custom_rotary_initialised,
}
