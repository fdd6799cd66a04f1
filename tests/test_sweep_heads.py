"""Model types whose heads differ per layer or whose attention is not the stock kind: the checks give verdicts.

Gemma4: a heterogeneous config (full-attention layers with their own head_dim, read per layer through
`config.per_layer_config`; the global `config.head_dim` raises) and one rope block per layer type.
"""

import pytest
from sweep_support import pinned

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
    # a model rotating one layer type by -p·θ and the other by +p·θ mixes two conventions: the reversed layer is named
    assert f"layer {layer} rotates by -p·θ while layers {1 - layer} rotate the other way" in result.summary


# --------------------------------------------------------------------------- DeepSeek-V4
def deepseek_v4(layer_types=("heavily_compressed_attention", "sliding_attention"), hca_rate=128, window=8):
    """Tiny DeepSeek-V4: 4 rope dims (2 pairs) in the trailing slice of each 32-dim head, interleaved; sliding layers
    rotate with rope key "main" (θ=1e4), compressed ones with "compress" (θ=1.6e5);
    hyper-connection streams [T, 4, D]."""
    import torch
    import transformers

    from posdiag.testing.multimodal import small_config

    config = small_config("deepseek_v4", head_dim=32, layer_types=list(layer_types), sliding_window=window,
                          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def compressed_layer_rotated_with_main_base(module, args, kwargs):
    """Planted: the compressed layer is handed the sliding layers' rotation (wrong base)."""
    embeddings = dict(kwargs["position_embeddings"])
    embeddings["compress"] = embeddings["main"]
    kwargs["position_embeddings"] = embeddings
    return args, kwargs


def test_deepseek_v4_rope_judges_trailing_dims_with_each_layers_rope_key():
    # window 128: the same token at every probed position gives the same q/k (a window of 8 lets the
    # compressed layer's input vary along the 256 probed positions, and the premise's floor with it)
    healthy = api.run_checks(from_module(deepseek_v4(window=128)), ["rope"], RunOptions(seq_len=12)).check("rope")
    assert healthy.status is Status.PASS, healthy.summary
    planted = deepseek_v4(window=128)
    planted.model.layers[0].self_attn.register_forward_pre_hook(compressed_layer_rotated_with_main_base,
                                                                with_kwargs=True)
    result = api.run_checks(from_module(planted), ["rope"], RunOptions(seq_len=12)).check("rope")
    assert result.status is Status.FAIL and "at layer 0" in result.summary, result.summary


def test_deepseek_v4_cache_and_causal_give_verdicts_static_cache_not_run():
    report = api.run_checks(from_module(deepseek_v4()), ["cache", "causal"], RunOptions(seq_len=12))
    cache, causal = report.check("cache"), report.check("causal")
    assert cache.status is Status.PASS, cache.summary
    assert "static cache paths not run: transformers cannot build a StaticCache" in cache.summary
    assert not any(p.startswith("static/") for p in cache.details["paths"])
    assert causal.status is Status.PASS, causal.summary  # hidden states [T, streams, D] compared per token


def test_deepseek_v4_generate_on_left_padded_batch_with_compressed_entries_fails():
    """Finding on stock transformers 5.24: with a compressed entry inside the prompt (rate 4), generate() on a
    left-padded batch differs from each row alone from the first decode step (0.48 relative, the same in float64);
    the sibling whose prompts hold no compressed entry (rate 128) PASSes."""
    healthy = api.run_checks(from_module(deepseek_v4(hca_rate=128)), ["generate"], RunOptions(seq_len=12))
    assert healthy.check("generate").status is Status.PASS, healthy.check("generate").summary
    buggy = api.run_checks(from_module(deepseek_v4(hca_rate=4)), ["generate"], RunOptions(seq_len=12))
    result = buggy.check("generate")
    if pinned(result, "deepseek_v4", "generate"):
        assert result.summary.startswith("dynamic/batch"), result.summary
        assert "failing: dynamic/batch)" in result.summary and "a bug" in result.summary


# --------------------------------------------------------------------------- Dory (looped layers)
def test_dory_small_config_has_one_layer_per_section_and_decodes():
    from posdiag.testing.multimodal import small_config

    config = small_config("dory")
    assert (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers) == (1, 1, 1)
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    report = api.run_checks(from_module(model), ["cache"], RunOptions(seq_len=12))
    assert report.check("cache").status is Status.PASS, report.check("cache").summary


def test_kernels_leaves_out_inputs_the_models_own_eager_forward_cannot_run():
    """A Dory config whose sections overlap (8 + 8 around 2 layers) crashes on any cached forward, eager included:
    kernels compares the other inputs and names the decode ones it could not run (never an error)."""
    model = zoo.tiny_model_of_type("dory", attn_implementation="eager", num_hidden_layers=2, n_input_layers=8,
                                   n_output_layers=8)
    result = api.run_checks(from_module(model), ["kernels"], RunOptions(seq_len=12)).check("kernels")
    assert result.status is Status.PASS, result.summary
    assert "not compared (the model's own eager forward raises): decode input" in result.summary
    assert result.details["not_compared"]


def sweep_deepseek_v4():
    """The sweep's tiny DeepSeek-V4: every layer type of the full pattern (compressed_sparse_attention rate 4)."""
    import torch
    import transformers

    from posdiag.testing.multimodal import small_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(small_config("deepseek_v4")).eval()


def test_deepseek_v4_compressed_pooling_is_storage_order_mixing_and_rotation_still_judged():
    """Compressed layers pool consecutive keys in storage order and rotate them at storage positions: no consistent
    permutation and no relative invariance under position_ids + k (by design)."""
    names = ["shuffle", "positions", "shift"]
    subject = from_module(sweep_deepseek_v4())
    assert "compress_rates: compressed_sparse_attention 4" in subject.family.token_mixing
    healthy = api.run_checks(subject, names, RunOptions(seq_len=12))
    for name in names:
        assert healthy.check(name).status in (Status.PASS, Status.NA), (name, healthy.check(name).summary)
    assert healthy.check("shift").status is Status.NA
    assert "storage position" in healthy.check("shift").summary


def test_deepseek_v4_left_padded_row_with_compressed_entry_differs_from_row_alone():
    """Finding on stock transformers 5.24: the compressor pools padding into the first window, so a left-padded row
    differs from the same row alone (0.435 relative from the first token that sees a compressed entry, the same in
    float64); the sibling without a compressed entry in the probe (rate 128) PASSes."""
    healthy = api.run_checks(from_module(deepseek_v4(hca_rate=128)), ["batch"], RunOptions(seq_len=12)).check("batch")
    assert healthy.status is Status.PASS, healthy.summary
    buggy = api.run_checks(from_module(deepseek_v4(("compressed_sparse_attention", "sliding_attention"))), ["batch"],
                           RunOptions(seq_len=12)).check("batch")
    if pinned(buggy, "deepseek_v4", "batch"):
        assert "left-padded" in buggy.summary and "a bug" in buggy.summary, buggy.summary
