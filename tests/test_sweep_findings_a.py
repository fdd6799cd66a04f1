"""Support-sweep rows judged on stock transformers 5.24: upstream findings pinned next to healthy twins, and the
posdiag fixes they asked for (a generate() refused by transformers is a SKIP; hybrids' small configs keep an
attention layer).

Models are built as the sweep builds them (posdiag.testing.multimodal.small_config, transformers' default init,
float32, CPU). Every FAIL here was decided in float64 (the same figure: not rounding) and reproduced with plain
transformers calls (figures in docs/support.md, "Findings on stock transformers").
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from sweep_support import SMALL_MAMBA2, pinned

from posdiag.api import run_checks
from posdiag.errors import refused_by_generation
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config, small_model

OPTIONS = RunOptions(seq_len=12)
GENERATE = RunOptions(seq_len=8, check_options={"generate": {"new_tokens": 3}})  # each failure shows by step 1
LEFT_DEFAULTS = "a left-padded, no position_ids (the model's defaults)"
DEFAULTS_WARN = ("left-padded rows without position_ids are numbered from the first padding column (documented for "
                 "absolute-position models): pass position_ids = attention_mask.cumsum(-1) - 1")


def build(model_type: str, config=None) -> torch.nn.Module:
    """The sweep's model of `model_type` (or of `config`): eager attention where the class takes it."""
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    return small_model(model_type, config=config)


def check(model, name: str, options: RunOptions | None = None):
    options = options or (GENERATE if name == "generate" else OPTIONS)
    return run_checks(from_module(model), [name], options).check(name)


def decided_bug(result, path: str) -> None:
    """The float64 re-run kept the figure: a bug, not rounding."""
    assert "a bug" in result.details["arbitration"]["decided"][path], result.details["arbitration"]


# ------------------------------------------------------------------ learned tables numbered from the first column
@pytest.mark.parametrize("model_type", ["gpt-sw3", "gpt_bigcode", "git", "biogpt", "ctrl", "xglm", "blip",
                                        "vision-encoder-decoder"])
def test_left_padded_default_positions_warn_like_gpt2(model_type):
    """GPT-SW3 (GPT-2's classes), GPTBigCode, GIT, BioGPT, CTRL and XGLM number positions by arange when called
    without position_ids, so a left-padded row starts at the padding: only that row fails (0.8-0.98; BioGPT, whose
    scaled embeddings dilute the table, 0.19; the same in float64: XGLM runs it only with float64 as torch's default
    dtype, its mask floor is built in the default dtype), and posdiag says how to call them: the caller's contract
    transformers documents for absolute positions, a WARN (BioGPT's table is written to read the mask, but its
    forward always passes arange first: a bug, listed as one, with the same WARN from batch)."""
    result = check(build(model_type), "batch")
    if model_type == "biogpt" and not pinned(result, "biogpt", "batch", Status.WARN):
        return
    assert result.status is Status.WARN and result.summary.startswith(DEFAULTS_WARN), result.summary
    assert "pass position_ids = attention_mask.cumsum(-1) - 1" in result.summary
    failing = {r for r, e in result.details["error_per_row"].items() if e > result.metrics["tolerance"]}
    assert failing == {LEFT_DEFAULTS}
    assert result.details["error_per_row"][LEFT_DEFAULTS] > 0.1  # the floor is ~1e-7
    decided_bug(result, LEFT_DEFAULTS)
    assert torch.get_default_dtype() is torch.float32  # XGLM's float64 re-run restored it


@pytest.mark.parametrize("zeroed", [False, True])
def test_ctrl_sinusoidal_buffer_is_the_table_judged(zeroed):
    """CTRL keeps its sinusoidal table as a `pos_encoding` buffer: found (position kind sinusoidal), probed, and a
    zeroed one (positions lost) FAILs."""
    model = build("ctrl")
    if zeroed:
        model.transformer.pos_encoding.zero_()
    result = check(model, "table")
    assert result.status is (Status.FAIL if zeroed else Status.PASS), result.summary
    assert from_module(model).position_kind == "sinusoidal"


def test_positions_from_the_mask_pass_the_same_rows():
    """OPT numbers positions from the attention mask: every row, the defaults too, equals itself alone."""
    result = check(build("opt"), "batch")
    assert result.status is Status.PASS, result.summary
    assert LEFT_DEFAULTS in result.details["error_per_row"]


# ------------------------------------------------------------------ GIT: cached steps widen the mask over no image
def test_git_generate_on_a_left_padded_batch_fails_from_the_first_cached_step():
    """Text-only GIT: each cached step prepends `image_patch_tokens` ones to the 2D mask for image tokens the
    cache does not hold, so the padding mask slides off the keys: left-padded rows differ from step 1 (0.27 in
    float32 and float64); unpadded rows agree."""
    result = check(build("git"), "generate")
    if not pinned(result, "git", "generate"):
        return
    runs = result.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.PASS
    assert runs["dynamic/batch"]["status"] is Status.FAIL
    assert "step 0 " not in runs["dynamic/batch"]["first_difference"]  # step 0 runs without a cache
    decided_bug(result, "dynamic/batch")


def test_git_generate_passes_once_the_mask_is_not_widened():
    """The healthy twin: the same GIT told it holds no image tokens (image_patch_tokens = 0) generates right."""
    model = build("git")
    for layer in model.git.encoder.layer:
        layer.attention.self.image_patch_tokens = 0
    result = check(model, "generate")
    assert result.status is Status.PASS, result.summary


# ------------------------------------------------------------------ FalconMamba: a chunk restarts the SSM state
def test_falcon_mamba_multi_token_continuation_fails():
    """FalconMamba's mixer scans a multi-token chunk from a zero state (the cached recurrent state is not read):
    0.04-0.1 relative against the full forward, the same in float64; single-token decode agrees."""
    result = check(build("falcon_mamba"), "cache")
    if not pinned(result, "falcon_mamba", "cache"):
        return
    paths = result.details["paths"]
    assert paths["dynamic/decode"]["status"] is Status.PASS
    assert paths["dynamic/chunks"]["status"] is Status.FAIL
    decided_bug(result, "dynamic/chunks")


# ------------------------------------------------------------------ GraniteMoeHybrid: no attention layer, no cache
def test_hybrid_small_configs_keep_an_attention_layer():
    """Cut to 2 layers, GraniteMoeHybrid's default (all Mamba), Jamba's (attention at layer 4) and LFM3's patterns
    hold no attention layer; the sweep's small configs keep one. Pure recurrent families stay as they are."""
    for model_type in ("granitemoehybrid", "jamba", "lfm3", "kimi_linear"):
        types = small_config(model_type).layer_types
        assert "full_attention" in types, (model_type, types)
    assert set(small_config("mamba").layer_types) == {"linear_attention"}
    mamba_only = ["linear_attention"] * 2
    assert small_config("granitemoehybrid", layer_types=mamba_only).layer_types == mamba_only


def test_granitemoehybrid_with_attention_caches_and_generates():
    model = build("granitemoehybrid", small_config("granitemoehybrid", **SMALL_MAMBA2))
    for name in ("cache", "generate"):
        result = check(model, name)
        assert result.status is Status.PASS, (name, result.summary)


def test_pure_mamba_granitemoehybrid_cannot_use_a_cache():
    """transformers' own default GraniteMoeHybrid config is all Mamba, and any cached forward of it raises in the
    mask builder (a cache of linear-attention layers only is refused: by Cache.get_seq_length up to transformers
    5.24, by Cache.get_mask_sizes from 5.25): cache and generate FAIL naming the exception."""
    model = build("granitemoehybrid", small_config("granitemoehybrid", layer_types=["linear_attention"] * 2,
                                                   **SMALL_MAMBA2))
    for name in ("cache", "generate"):
        pinned(check(model, name), "granitemoehybrid:all-mamba", name)


# ------------------------------------------------------------------ ConvBERT: the convolution reads the padding
def test_convbert_padding_leaks_through_the_span_convolution():
    """ConvBERT's convolution branch (kernel 9) mixes neighbouring tokens with no attention mask, so padding moves
    the valid tokens next to it, and through attention every token (0.004 relative, the same in float64)."""
    result = check(build("convbert"), "batch")
    if not pinned(result, "convbert", "batch"):
        return
    assert result.details["error_per_row"]["a right-padded"] > 1e-3
    decided_bug(result, "a right-padded")


def test_convbert_with_a_one_token_kernel_passes():
    """The healthy twin: a kernel of 1 reads only the token itself, so padding cannot reach a valid token."""
    result = check(build("convbert", small_config("convbert", conv_kernel_size=1)), "batch")
    assert result.status is Status.PASS, result.summary


# ------------------------------------------------------------------ FSMT: a static cache without a mask
def test_fsmt_static_cache_generate_fails_dynamic_passes():
    """FSMT's cached decoder passes no attention mask, so with a static cache the first step already attends the
    empty slots (0.02-0.03 relative at step 0, the same in float64); the dynamic cache agrees."""
    result = check(build("fsmt"), "generate")
    if not pinned(result, "fsmt", "generate"):
        return
    runs = result.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.PASS and runs["dynamic/batch"]["status"] is Status.PASS
    assert runs["static/single"]["status"] is Status.FAIL
    assert runs["static/single"]["first_difference"].startswith("row 0 step 0 ")
    decided_bug(result, "static/single")


def test_bart_static_cache_generate_passes():
    result = check(build("bart"), "generate")
    assert result.status is Status.PASS, result.summary


# ------------------------------------------------------------------ refusals are skips, crashes are not
def tiny_encoder_decoder(**tokens) -> torch.nn.Module:
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=256,
                 max_position_embeddings=64)
    enc = transformers.BertConfig(**sizes)
    dec = transformers.BertConfig(**sizes, is_decoder=True, add_cross_attention=True)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    for key, value in tokens.items():
        setattr(config, key, value)
    return build("encoder-decoder", config)


def test_generate_refused_by_the_config_is_a_skip_with_the_reason():
    """EncoderDecoderModel's default config has no decoder_start_token_id: transformers refuses generate() in its
    special-token validation, before the model runs. Not a crash on an accepted path: SKIP, saying why."""
    result = check(tiny_encoder_decoder(), "generate")
    assert result.status is Status.SKIP, result.summary
    assert "refuses" in result.summary and "decoder_start_token_id" in result.summary


def test_generate_with_the_token_defined_is_judged():
    result = check(tiny_encoder_decoder(decoder_start_token_id=1, pad_token_id=0), "generate")
    assert result.status is Status.PASS, result.summary


def test_a_value_error_from_the_model_is_still_a_crash():
    """The twin of the refusal: a ValueError raised by the model's own forward during generate() is a FAIL."""
    model = build("llama")

    def broken(module, args, kwargs):
        if kwargs.get("cache") is not None and kwargs["cache"].get_seq_length() > 0:
            raise ValueError("planted: cached step refused")

    model.model.register_forward_pre_hook(broken, with_kwargs=True)
    result = check(model, "generate")
    assert result.status is Status.FAIL and "crashed" in result.summary and "planted" in result.summary, result.summary


def test_refused_by_generation_reads_where_the_error_was_raised():
    model = tiny_encoder_decoder()
    with pytest.raises(ValueError) as info:
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=1)
    assert refused_by_generation(info.value)
    try:
        raise ValueError("not from generation")
    except ValueError as exc:
        assert not refused_by_generation(exc)
