"""Pure RoPE math against DESIGN's reference figures (configs built from known parameters, no download)."""

import numpy as np
import pytest
import transformers

from posdiag.tools import rope_math as rm


def llama2():
    return transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def llama31():
    return transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def test_llama2_reference_figures():
    (r,) = rm.analyze_config(llama2())
    assert r.spec.rotary_dim == 128 and r.after.pairs == 64
    assert r.after.critical_pair == 46
    assert r.after.longest_wavelength == pytest.approx(54410, rel=1e-3)  # "~54k"
    assert 1600 < r.after.decay_first_zero < 1800  # "near 1.7k", inside the 4k context: information only
    assert r.after.alias_offset is None and r.after.alias_scanned == 4096  # none up to N
    assert r.warnings == ()
    assert r.after.turns_training[0] == pytest.approx(4096 / (2 * np.pi))


def test_llama31_reference_figures_and_before_after():
    (r,) = rm.analyze_config(llama31())
    assert r.spec.training_length == 8192 and r.spec.claimed_length == 131072
    assert r.after.critical_pair == 32
    assert r.after.longest_wavelength == pytest.approx(2.0e7, rel=0.03)
    assert r.before.critical_pair == 35  # unscaled frequencies against the same L
    assert r.before.longest_wavelength == pytest.approx(r.after.longest_wavelength / 8, rel=1e-6)
    # Frequencies come from transformers' own llama3 function.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](llama31(), "cpu")
    np.testing.assert_allclose(r.after.freqs, ref.double().numpy())
    assert r.warnings == ()  # a healthy, widely used model: no heuristic warnings


def test_target_beyond_claims_warns_with_evidence():
    (r,) = rm.analyze_config(llama2(), target_length=16384)
    assert r.after.unseen_pairs == 64 - 46
    assert len(r.warnings) == 1 and "beyond the 4096 tokens" in r.warnings[0]


def test_declared_context_beyond_original_without_scaling_warns():
    cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=16384,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 4096})
    (r,) = rm.analyze_config(cfg)
    assert any("exceeds the original training length" in w for w in r.warnings)


def test_alias_and_decay_on_known_frequencies():
    freqs = 2 * np.pi / np.array([10.0, 20.0, 25.0])  # every pair returns at D = 100
    assert rm.alias_offset(freqs, 1000) == 100
    assert rm.alias_offset(freqs, 99) is None
    assert rm.decay_first_zero(np.array([np.pi / 8]), 100) == 5  # cos(4π/8) = 6e-17 > 0, cos(5π/8) < 0
    assert rm.critical_pair(freqs, 22) == 2  # first λ > 22 is 25


def test_per_layer_types_partial_and_gptj():
    gemma3 = transformers.Gemma3TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    specs = {s.layer_type: s for s in rm.rope_specs(gemma3)}
    assert specs["sliding_attention"].theta == 10000.0 and specs["full_attention"].theta == 1e6
    phi = transformers.PhiConfig(hidden_size=64, num_attention_heads=4)
    (s,) = rm.rope_specs(phi)
    assert (s.head_dim, s.rotary_dim, s.partial_rotary_factor) == (16, 8, 0.5)
    assert rm.inv_freq(phi, s)[0].shape == (4,)
    gptj = transformers.GPTJConfig(n_embd=64, n_head=4, rotary_dim=8)
    (g,) = rm.rope_specs(gptj)
    assert (g.rotary_dim, g.theta) == (8, 10000.0)
    assert rm.rope_specs(transformers.GPT2Config()) == []


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
])
def test_scaled_types_use_transformers_functions(rope):
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                                   rope_parameters=rope)
    (spec,) = rm.rope_specs(cfg)
    freqs, scaling = rm.inv_freq(cfg, spec)
    unscaled = rm.unscaled_inv_freq(spec)
    assert freqs.shape == unscaled.shape == (32,)
    if spec.stateful:  # below the switch point dynamic keeps the base; beyond it, lower frequencies
        assert spec.switch_length == 4096
        np.testing.assert_allclose(freqs, unscaled, rtol=1e-6)
        freqs = rm.inv_freq(cfg, spec, seq_len=8192)[0]
    assert freqs[-1] < unscaled[-1] * 0.9  # the lowest frequency is stretched
    if rope["rope_type"] == "yarn":
        assert scaling > 1.0
