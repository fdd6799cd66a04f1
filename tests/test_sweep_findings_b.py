"""Support-sweep rows on healthy default-init tiny models (posdiag.testing.multimodal.small_config): the small
config must stay consistent and representative, and the checks must read per-layer RoPE layouts as the model runs
them. Upstream findings are pinned next to a healthy sibling."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from sweep_support import holds, pinned

from posdiag.api import run_checks
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _subject(model_type: str, **overrides):
    config = small_config(model_type, **overrides)
    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config, attn_implementation="eager")
    return from_module(model.eval(), name=model_type)


def _status(subject, check: str, seq_len: int = 12):
    return run_checks(subject, [check], RunOptions(seq_len=seq_len)).check(check)


def test_small_config_head_emits_only_ids_of_the_embedding():
    # Inkling2's head has unpadded_vocab_size rows (fewer than the padded embedding); left at its default (200058)
    # the head emitted ids past the 256-row embedding and generate() fed them back: IndexError.
    for model_type in ("inkling2_text", "inkling2_loop_text"):
        config = small_config(model_type)
        assert config.unpadded_vocab_size <= config.vocab_size


@pytest.mark.slow  # ~15 s: generate() with dynamic and static caches through Inkling2's short convolutions
def test_inkling2_generate_passes():
    result = _status(_subject("inkling2_text", max_position_embeddings=32, n_routed_experts=4,
                               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16), "generate")
    assert result.status is Status.PASS, result.summary


def test_small_config_keeps_every_layer_type():
    # Flint's first two layers are full attention, which runs without RoPE: a 2-layer Flint had no position at all.
    assert small_config("flint").layer_types == ["full_attention", "sliding_attention"]
    assert small_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]


def test_flint_rope_passes_and_names_its_nope_layer():
    result = _status(_subject("flint"), "rope")
    assert result.status is Status.PASS, result.summary
    assert "layer 0 (no RoPE by design" in result.summary


def test_unrotated_layer_of_a_rotating_type_still_fails():
    # The twin: layer 0 is a sliding layer like layer 1, yet skips the rotation (Flint rotates where sliding_window
    # is set): no design reason, so the rotation is judged there and fails.
    subject = _subject("flint", layer_types=["sliding_attention", "sliding_attention"])
    subject.model.model.layers[0].self_attn.sliding_window = None
    result = _status(subject, "rope")
    assert result.status is Status.FAIL and "at layer 0" in result.summary, result.summary


def test_all_nope_flint_is_not_called_a_pairing_mismatch():
    # Both layers full attention (no rotation anywhere): the failure is the missing rotation, not "q interleaved,
    # k half" (both layouts fitted within a tolerance widened by the sinks' position-dependent layer input).
    result = _status(_subject("flint", layer_types=["full_attention", "full_attention"]), "rope")
    assert result.status is Status.FAIL and "paired differently" not in result.summary, result.summary


def test_beam_rope_skips_its_declared_nope_layer():
    result = _status(_subject("beam"), "rope")
    assert result.status is Status.PASS, result.summary
    assert "layer 1 (no RoPE by design: the config gives 'full_attention' layers no rotary block)" in result.summary


def test_beam_shift_names_its_absolute_query_scale(monkeypatch):
    result = _status(_subject("beam"), "shift")
    assert result.status is Status.NA and "scalable softmax" in result.summary, result.summary
    # The twin: with that scale held at 1 the same model is shift-invariant, and the check passes.
    from transformers.models.beam import modeling_beam

    monkeypatch.setattr(modeling_beam, "compute_attention_scaling",
                        lambda p: torch.ones(p.shape, dtype=torch.float)[:, None, :, None])
    result = _status(_subject("beam"), "shift")
    assert result.status is Status.PASS, result.summary


def test_hunyuan_vl_xdrope_is_no_rotation_for_image_tokens():
    # Upstream (transformers 5.24): HunYuanVLRotaryEmbedding.recomposition_frequencies splits cat(freq, freq) into
    # chunks of 2 * section, so with rotate_half the two halves of a pair read different streams (t with w, h with
    # the 4th) and an image token's q is not rotated but distorted; the reference XD-RoPE repeats the section list.
    from transformers.models.hunyuan_vl import modeling_hunyuan_vl as hy

    config = small_config("hunyuan_vl").text_config
    rotary = hy.HunYuanVLRotaryEmbedding(config)
    q = torch.randn(1, 1, 1, config.head_dim, dtype=torch.float64)
    half = config.head_dim // 2

    def pair_norms(x):
        return (x[..., :half] ** 2 + x[..., half:] ** 2).sqrt()

    distorted = holds("hunyuan_vl", "rope")  # where upstream fixed it, an image token is rotated like a text token
    for streams, image in (([5, 5, 5], False), ([5, 9, 3], True)):  # a text token, then an image token
        cos, sin = rotary(q, torch.tensor(streams)[:, None, None])
        rotated, _ = hy.apply_rotary_pos_emb(q, q, cos.double(), sin.double())
        change = float((pair_norms(rotated) - pair_norms(q)).abs().max())
        assert change > 1e-2 if image and distorted else change < 1e-6, (streams, change)
    pinned(_status(_subject("hunyuan_vl"), "rope"), "hunyuan_vl", "rope")


def test_qwen2_vl_chunked_mrope_passes():  # the healthy sibling: chunked sections, pair halves share a stream
    result = _status(_subject("qwen2_vl"), "rope")
    assert result.status is Status.PASS, result.summary


def test_beam_left_padded_without_ids_reads_the_padding_through_its_query_scale(monkeypatch):
    """Beam's RoPE-less layers scale queries by (1 + (p+1)/2048)**0.1 of the absolute position: called without
    position_ids (arange from the first padding column) a left-padded row differs from itself alone (5e-5, ~80x the
    floor, the same in float64); explicit ids are exact: the caller's contract, a WARN with the fix. The twin with
    that scale held at 1 passes every row."""
    result = _status(_subject("beam"), "batch", seq_len=16)
    assert result.status is Status.WARN and "pass position_ids = attention_mask.cumsum(-1) - 1" in result.summary, \
        result.summary
    failing = {r for r, e in result.details["error_per_row"].items() if e > result.metrics["tolerance"]}
    assert failing == {"a left-padded, no position_ids (the model's defaults)"}, result.details["error_per_row"]
    from transformers.models.beam import modeling_beam

    monkeypatch.setattr(modeling_beam, "compute_attention_scaling",
                        lambda p: torch.ones(p.shape, dtype=torch.float)[:, None, :, None])
    result = _status(_subject("beam"), "batch", seq_len=16)
    assert result.status is Status.PASS, result.summary


@pytest.mark.parametrize("window", [128, 4096])
def test_moshi_cached_decoding_past_its_sliding_window_differs_from_the_forward(window):
    """Moshi's decoder with a sliding window shorter than the probe: cached decoding (and generate()) past the window
    differs from the full forward (0.2 relative, the same in float64); with the window beyond the probe both PASS."""
    result = _status(_subject("moshi", sliding_window=window), "cache", seq_len=16)
    if window < 256:
        pinned(result, "moshi", "cache")
    else:
        assert result.status is Status.PASS, result.summary
