"""Support-sweep rows on cached decoding past a sliding window: the small config sets a window only where the model
type's forward applies one, reference sliding-window layers are judged against the forward with the same prefill,
and Moshi's finding (its forward ignores the window its cache applies) is shown with plain transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from sweep_support import holds, pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config, small_model

SMALL = dict(sliding_window=8, max_position_embeddings=32)  # the cache check runs 2 * 8 + 4 = 20 tokens


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _cache(model_type: str, subject=None, **overrides):
    subject = subject or from_module(small_model(model_type, **overrides), name=model_type)
    return run_checks(subject, ["cache"], RunOptions(seq_len=16)).check("cache")


@pytest.fixture(scope="module")
def ocr():
    """One Unlimited-OCR subject for both tests. Its vision tower (400M parameters at the default sizes) is not run on
    text and is dropped, so the FAIL's float64 re-run converts the language model alone."""
    model = small_model("unlimited_ocr", **SMALL)
    model.model.vision_tower = torch.nn.Identity()
    return from_module(model, name="unlimited_ocr")


def test_small_config_sets_a_window_only_where_the_forward_applies_one():
    # Qwen3-VL-MoE's config pins sliding_window to None and Qwen3-Omni's thinker checkpoints carry null: neither
    # forward builds a sliding mask, but DynamicCache(config) windowed the cache when the small config set 128.
    assert small_config("qwen3_vl_moe").text_config.sliding_window is None
    assert small_config("qwen3_omni_moe_thinker").text_config.sliding_window is None
    # Types whose default is None but whose forward applies a set window keep it (Mistral-style masks), and a type
    # whose checkpoints carry a window keeps it shrunk (Moshi: 3000).
    for model_type in ("phi3", "starcoder2", "mistral", "moshi"):
        assert small_config(model_type).sliding_window == 128, model_type
    assert small_config("qwen3_vl_moe", sliding_window=8).text_config.sliding_window == 8  # overrides still win


@pytest.mark.parametrize("window", [None, 8])
def test_a_window_the_forward_ignores_fails_cache_and_none_passes(window):
    # Qwen3-VL-MoE with a window set by hand: the forward attends every token, the DynamicCache keeps window - 1
    # (0.2 relative past the window, the same in float64). Its checkpoints set none: the default PASSes.
    result = _cache("qwen3_vl_moe", sliding_window=window, max_position_embeddings=32)
    if window is None:
        assert result.status is Status.PASS, result.summary
    else:
        pinned(result, "qwen3_vl_moe:sliding_window", "cache")


def test_reference_sliding_window_cache_passes_against_the_forward_with_its_prefill_declared(ocr):
    # Unlimited-OCR's R-SWA: tokens after the first forward see every prefill token and only the last window of their
    # own, by design; the full forward without a cache treats all as prefill.
    result = _cache("unlimited_ocr", ocr)
    assert result.status is Status.PASS, result.summary
    assert result.details["seq_len"] == 20 and "reference" in result.details


def test_reference_sliding_window_cache_fails_against_the_plain_forward(ocr, monkeypatch):
    # Without the declared prefill the reference is the plain forward: chunks past the window differ (the twin that
    # shows the comparison can fail on this layer type).
    from transformers.models.unlimited_ocr import modeling_unlimited_ocr as modeling

    monkeypatch.setattr(modeling.UnlimitedOcrDynamicReferenceSlidingWindowLayer, "set_prefill_length",
                        lambda self, n: None)
    result = _cache("unlimited_ocr", ocr)
    assert result.status is Status.FAIL and "chunks" in result.summary, result.summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moshi_forward_ignores_the_window_its_cache_applies(dtype):
    # Plain transformers: Moshi's forward builds a plain causal mask (MoshiDecoderLayer stores sliding_window and never
    # reads it) while the DynamicCache(config) it builds keeps window - 1 tokens. Decoding token by token equals the
    # forward with a window mask to rounding and differs from Moshi's own forward past the window.
    window, length = 8, 20
    torch.manual_seed(0)
    config = small_config("moshi", sliding_window=window, max_position_embeddings=32)
    model = transformers.MoshiForCausalLM(config).eval().to(dtype)
    ids = torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(0))
    i = torch.arange(length)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    mask = torch.zeros(length, length, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    with torch.no_grad():
        full = model(input_ids=ids).logits[0]
        windowed = model(input_ids=ids, attention_mask=mask).logits[0]
        cache, steps = None, []
        for t in range(length):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache, steps = out.past_key_values, [*steps, out.logits[0, -1]]
    steps = torch.stack(steps)
    rounding = 1e-5 if dtype is torch.float32 else 1e-12

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(steps[:window], full[:window]) < rounding  # within the window the three agree
    if not holds("moshi", "cache"):  # fixed upstream: decoding is the forward, whichever side changed
        assert rel(steps, full) < rounding
        return
    assert rel(steps, windowed) < rounding
    assert rel(steps[window:], full[window:]) > 0.05
