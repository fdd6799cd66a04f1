"""Model types whose heads differ per layer or whose attention is not the stock kind: the checks give verdicts.

Gemma4: a heterogeneous config (full-attention layers with their own head_dim, read per layer through
`config.per_layer_config`; the global `config.head_dim` raises) and one rope block per layer type.
"""

import pytest

from posdiag import api
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.tools import rope_math


def gemma4(**overrides):
    """Tiny Gemma4 text model: layer 0 sliding (head_dim 8, θ=1e4), layer 1 full (head_dim 32, proportional θ=1e6)."""
    return zoo.tiny_model_of_type("gemma4_text", attn_implementation="eager", num_hidden_layers=2,
                                  global_head_dim=32, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
                                  **overrides)


def reverse_rotation(module, args, kwargs):
    """Planted: this attention layer rotates by -p·θ (sin negated); attention stays relative, the rotation is wrong."""
    cos, sin = kwargs["position_embeddings"]
    kwargs["position_embeddings"] = (cos, -sin)
    return args, kwargs


def test_gemma4_rope_specs_carry_each_layer_types_head_dim():
    specs = {s.layer_type: s for s in rope_math.rope_specs(gemma4().config)}
    assert (specs["sliding_attention"].head_dim, specs["sliding_attention"].rotary_dim) == (8, 8)
    assert (specs["full_attention"].head_dim, specs["full_attention"].rotary_dim) == (32, 8)
    freqs, _ = rope_math.inv_freq(gemma4().config, specs["full_attention"])
    assert freqs.shape == (16,)  # proportional RoPE: head_dim/2 frequencies, the non-rotary ones zero


def test_gemma4_healthy_gives_verdicts_on_cache_generate_rope():
    report = api.run_checks(from_module(gemma4()), ["cache", "generate", "rope"], RunOptions(seq_len=12))
    for name in ("cache", "generate", "rope"):
        assert report.check(name).status is Status.PASS, (name, report.check(name).summary)
    assert "proportional θ=1e+06 (full_attention)" in report.check("rope").summary


@pytest.mark.parametrize("layer", [0, 1])
def test_gemma4_rotation_reversed_on_one_layer_type_fails_rope(layer):
    model = gemma4()
    model.model.layers[layer].self_attn.register_forward_pre_hook(reverse_rotation, with_kwargs=True)
    result = api.run_checks(from_module(model), ["rope"], RunOptions(seq_len=12)).check("rope")
    assert result.status is Status.FAIL, result.summary
    assert f"applied rotation disagrees with the config at layer {layer}" in result.summary
