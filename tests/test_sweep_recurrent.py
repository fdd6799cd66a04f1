"""Support-sweep rows of recurrent, looped and relative-position models on stock transformers 5.24: the posdiag
fixes they asked for (small configs that really are small and keep an attention layer, a looped model's layers
judged once, kernels continuing a cache under transformers 5.x's `cache=` name, DeBERTa-v3's storage-order relative
positions) and the upstream findings, pinned next to healthy twins.

Models are built as the sweep builds them (posdiag.testing.multimodal.small_config, transformers' default init,
float32, CPU). Every FAIL here was decided in float64 (the same figure: not rounding) and reproduced with plain
transformers calls (figures in docs/support.md, "Findings on stock transformers").
"""

from __future__ import annotations

import warnings

import torch
import transformers
from sweep_support import pinned, sweep_module

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.testing.multimodal import small_config, small_model

OPTIONS = RunOptions(seq_len=12)
LEFT_DEFAULTS = "a left-padded, no position_ids (the model's defaults)"
DEBERTA_V3 = dict(relative_attention=True, position_biased_input=False, pos_att_type=["p2c", "c2p"],
                  position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True)


def build(model_type: str, **overrides) -> torch.nn.Module:
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    return small_model(model_type, **overrides)


def test_small_config_shrinks_sizes_stored_under_the_configs_own_names():
    # GPT-J/CodeGen store hidden_size as n_embd (attribute_map): the sweep built them at 28 layers of 4096 (6B).
    for model_type in ("gptj", "codegen"):
        config = small_config(model_type)
        assert (config.n_embd, config.n_layer, config.n_head) == (64, 2, 4)
        assert 2 <= config.rotary_dim <= config.n_embd // config.n_head  # 64 of a 256-dim head -> 4 of 16
    config = small_config("xlm")
    assert (config.emb_dim, config.n_layers) == (64, 2)


def test_small_config_keeps_an_attention_layer_of_block_types_and_attn_layer_indices_hybrids():
    # RecurrentGemma's pattern comes from block_types (recurrent, recurrent, attention): 2 layers were both
    # recurrent and every cached call raised; Bamba's default (attn_layer_indices None) is all Mamba.
    gemma = small_config("recurrent_gemma")
    assert "sliding_attention" in gemma.layer_types and gemma.attention_window_size <= 128
    assert "full_attention" in small_config("bamba").layer_types
    assert set(small_config("mamba").layer_types) == {"linear_attention"}  # no attention by design: left as is


def test_looped_dory_layers_are_judged_once_and_kernels_continue_the_cache():
    # Dory runs its recurrent layer twice per forward: the second call was judged as the next layer (another
    # theta) and `rope` FAILed at 1.1e6x; `kernels` passed past_key_values, which Dory drops into **kwargs.
    model = build("dory")
    report = run_checks(from_module(model, name="dory"), ["rope", "kernels"], OPTIONS)
    assert report.check("rope").status is Status.PASS, report.check("rope").summary
    assert report.check("kernels").status is Status.PASS, report.check("kernels").summary
    # planted twin: the full-attention (looped) layer rotated with the sliding layers' frequencies
    rotary = model.model.rotary_emb
    rotary.full_attention_inv_freq.copy_(rotary.sliding_attention_inv_freq)
    rope = run_checks(from_module(model, name="dory"), ["rope"], OPTIONS).check("rope")
    assert rope.status is Status.FAIL and "full_attention" in rope.summary, rope.summary


def test_rwkv_ignores_its_attention_mask_and_mamba_reads_it():
    rwkv = run_checks(from_module(build("rwkv"), name="rwkv"), ["batch"], OPTIONS).check("batch")
    if pinned(rwkv, "rwkv", "batch"):  # by design: the published recurrence has no mask
        assert "ignores its attention_mask" in rwkv.summary, rwkv.summary
        assert rwkv.details["attention_mask_ignored"] is True
        errors = rwkv.details["error_per_row"]
        assert errors["a right-padded"] < 1e-5 and errors["a left-padded"] > 0.1  # a causal recurrence sees no pads
    mamba = run_checks(from_module(build("mamba"), name="mamba"), ["batch"], OPTIONS).check("batch")
    assert mamba.status is Status.PASS, mamba.summary


def test_recurrent_gemma_findings_left_padding_without_ids_and_chunked_continuation():
    model = build("recurrent_gemma", sliding_window=8)  # the cache check runs past the window: 20 tokens
    options = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 2}})
    report = run_checks(from_module(model, name="recurrent_gemma"), ["batch", "cache"], options)
    batch = report.check("batch")
    # only the defaults break (the recurrence is not reset at the first real token): the caller's contract, a WARN
    if pinned(batch, "recurrent_gemma", "batch", Status.WARN):
        failing = [r for r, e in batch.details["error_per_row"].items() if e > 1e-3]
        assert failing == [LEFT_DEFAULTS], batch.details["error_per_row"]  # explicit position_ids reset the recurrence
    cache = report.check("cache")
    if not pinned(cache, "recurrent_gemma", "cache"):
        return
    paths = cache.details["paths"]
    # every multi-token chunk restarts the convolution state; one token at a time agrees up to transformers 5.24,
    # and from 5.25 (the state moved into Cache layers) only where the step's position_ids are given: a cached step
    # without them is numbered from 0 (test_findings_plain's reproduction)
    numbered_from_0 = sweep_module().finding("recurrent_gemma", "cache").path == "dynamic/decode"
    agrees = {name for name, p in paths.items() if p["status"] is Status.PASS}
    decode = {name for name in paths if "decode" in name}
    assert agrees == ({n for n in decode if "position_ids" in n} if numbered_from_0 else decode), paths


def test_deberta_v3_relative_positions_from_storage_order_and_a_twin_without_positions():
    subject = from_module(zoo.tiny_model_of_type("deberta-v2", head="base", **DEBERTA_V3), name="deberta-v2")
    report = run_checks(subject, ["shuffle", "positions"], RunOptions(seq_len=16))
    shuffle, positions = report.check("shuffle"), report.check("positions")
    assert shuffle.status is Status.PASS and "storage order" in shuffle.summary, shuffle.summary
    assert positions.status is Status.NA and "takes no position_ids" in positions.summary, positions.summary
    # planted: relative attention off and no absolute table: nothing carries position
    twin = from_module(zoo.tiny_model_of_type("deberta-v2", head="base", **{**DEBERTA_V3, "relative_attention": False}),
                       name="deberta-v2")
    assert run_checks(twin, ["shuffle"], RunOptions(seq_len=16)).check("shuffle").status is Status.FAIL


def test_recurrent_gemma_shift_names_the_reset_at_position_zero():
    """RecurrentGemma's RG-LRU resets its state where position_ids == 0, so shifting every position moves the reset:
    absolute by design (0.018 at shift 1, the same in float64), a SKIP naming it, not a FAIL of relative invariance."""
    result = run_checks(from_module(build("recurrent_gemma")), ["shift"], RunOptions(seq_len=12)).check("shift")
    assert result.status is Status.NA and "resets its state where position_ids is 0" in result.summary, result.summary
