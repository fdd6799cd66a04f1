"""Decoders from the support sweep that posdiag misread, each next to what must still fail.

- OpenAI GPT: a learned table named `positions_embed`, a hard-coded causal buffer, 2D padding masks only, no
  SDPA, no KV cache. The order checks drive it through its buffers; `cache` and the decode inputs of `kernels`
  skip (nothing is cached); without position_ids it numbers a left-padded row from the first padding column, the
  GPT-2 caller's contract, a WARN (0.90 relative in float64, explicit ids exact).
- NanoChat rotates by -p·θ in q and k alike (relative, so `rope` passes); q and k in opposite directions fail.
- NoPE layers the config declares (SmolLM3 `no_rope_layers`, Muse Glimmer `layer_rope_theta` 0) must rotate
  nothing, and layers it does not declare NoPE must rotate.
- A multimodal model's position kind comes from its language model, not from a rotary module in a tower.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from tests import plants_rope as P

LEFT_DEFAULTS = "a left-padded, no position_ids (the model's defaults)"
DEFAULTS_WARN = ("left-padded rows without position_ids are numbered from the first padding column (documented for "
                 "absolute-position models): pass position_ids = attention_mask.cumsum(-1) - 1")


def checks(model, names, seq_len=12):
    report = run_checks(from_module(model), names, RunOptions(seq_len=seq_len))
    return {c.name: c for c in report.checks}


# ------------------------------------------------------------------ OpenAI GPT
@pytest.fixture(scope="module")
def openai_gpt():
    return zoo.tiny_model_of_type("openai-gpt")


def test_openai_gpt_is_driven_through_its_causal_buffers(openai_gpt):
    subject = from_module(openai_gpt)
    assert subject.position_kind == "learned"
    got = checks(openai_gpt, ["shuffle", "positions", "causal", "table", "generate"])
    for name, result in got.items():
        assert result.status is Status.PASS, f"{name}: {result.summary}"


def test_openai_gpt_without_positions_fails_shuffle():
    model = zoo.tiny_model_of_type("openai-gpt")
    with torch.no_grad():
        model.transformer.positions_embed.weight.zero_()
    result = checks(model, ["shuffle"])["shuffle"]
    assert result.status is Status.FAIL, result.summary


def test_openai_gpt_keeps_no_cache(openai_gpt):
    got = checks(openai_gpt, ["cache", "kernels"])
    assert got["cache"].status is Status.NA and "keeps no KV cache" in got["cache"].summary
    assert got["kernels"].status is Status.SKIP and "refuses sdpa" in got["kernels"].summary


def test_openai_gpt_left_padding_without_ids_warns_like_gpt2(openai_gpt):
    result = checks(openai_gpt, ["batch"])["batch"]
    assert result.status is Status.WARN and result.summary.startswith(DEFAULTS_WARN), result.summary
    assert "pass position_ids = attention_mask.cumsum(-1) - 1" in result.summary
    errors, tolerance = result.details["error_per_row"], result.metrics["tolerance"]
    assert {r for r, e in errors.items() if e > tolerance} == {LEFT_DEFAULTS}  # every other row (explicit ids) right
    assert errors[LEFT_DEFAULTS] > 0.5


# ------------------------------------------------------------------ rotation direction
def _forward(x, cos, sin):
    """R_p, Llama's rotate-half rotation."""
    return x * cos + rotate_half(x) * sin


def _reversed(x, cos, sin):
    """R_-p: NanoChat's rotate_half is (x2, -x1), i.e. x·cos - rotate_half(x)·sin in Llama's terms."""
    return x * cos - rotate_half(x) * sin


def _unrotated(x, cos, sin):
    return x


def _port(rotate_q, rotate_k):
    model = P.faithful_port()
    for module in model.modules():
        if hasattr(module, "rotate_k"):
            module.rotate_q, module.rotate_k = rotate_q, rotate_k
    return model


def test_nanochat_rotates_backwards_consistently():
    result = checks(zoo.tiny_model_of_type("nanochat", attn_implementation="eager"), ["rope"])["rope"]
    assert result.status is Status.PASS, result.summary
    assert "-p·θ in q and k alike" in result.summary


@pytest.mark.parametrize(("rotate_q", "rotate_k", "status"), [
    (_reversed, _reversed, Status.PASS),  # relative: <R_-m q, R_-n k> = <q, R_(m-n) k>
    (_forward, _reversed, Status.FAIL),  # q forwards, k backwards: depends on n + m
    (_reversed, _unrotated, Status.FAIL),  # k never rotated
])
def test_direction_must_agree_between_q_and_k(rotate_q, rotate_k, status):
    result = checks(_port(rotate_q, rotate_k), ["rope"])["rope"]
    assert result.status is status, result.summary
    if rotate_k is _reversed and rotate_q is _forward:
        assert "opposite directions" in result.summary


# ------------------------------------------------------------------ NoPE layers
@pytest.mark.parametrize(("built", "declared", "status"), [
    ([1, 0], [1, 0], Status.PASS),  # layer 1 NoPE, as declared
    ([1, 1], [1, 0], Status.FAIL),  # declared NoPE, rotates
    ([1, 0], [1, 1], Status.FAIL),  # declared RoPE, rotates nothing
])
def test_nope_layers_follow_the_config(built, declared, status):
    model = zoo.tiny_model_of_type("smollm3", no_rope_layers=built, pad_token_id=0, attn_implementation="eager")
    model.config.no_rope_layers = declared
    result = checks(model, ["rope"])["rope"]
    assert result.status is status, result.summary
    if status is Status.PASS:
        assert "NoPE layer 1 rotates nothing" in result.summary


# ------------------------------------------------------------------ multimodal position kind
def test_tower_rotary_does_not_make_the_language_model_rope():
    """Nemotron 3.5 Transcribe: NoPE attention + Mamba language model, rotary modules in its audio encoder; read as
    RoPE, `shift` failed it (positions moved nothing) and `positions` failed (ids ignored)."""
    from transformers import AutoConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    text = AutoConfig.for_model("nemotron_h", hidden_size=32, num_hidden_layers=2,
                                layers_block_type=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, intermediate_size=64,
                                vocab_size=256, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8,
                                chunk_size=16, pad_token_id=0)
    vision = AutoConfig.for_model("pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, head_dim=8, image_size=32, patch_size=16)
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=255)
    model = LlavaForConditionalGeneration(config).eval()
    model.model.vision_tower.rotary_emb = LlamaRotaryEmbedding(zoo.tiny_config("llama"))  # a tower's own RoPE
    subject = from_module(model)
    assert subject.position_kind == "none found"
    got = checks(model, ["shift", "positions"])
    for result in got.values():  # no position mechanism: neither check applies
        assert result.status is Status.NA, result.summary
