"""Support-sweep rows of the Inkling family (inkling_text, inkling_mm_model, inkling2*, inkling2_loop*) on healthy
default-init tiny models: two upstream findings in stock transformers 5.24, each pinned next to a healthy sibling.

- Inkling (v1) with a StaticCache puts its relative position bias one step off in its full-attention layers: it reads
  the query offset (the static layer's length *tensor*) before `cache.update` and uses it after, when the update has
  grown it in place. Inkling2 computes the offsets once per forward and passes.
- generate(cache_implementation="static") builds its masks with transformers' table, which maps a "hybrid_sliding"
  layer to a full causal mask as long as the static full layers, while the sliding layers hold only the window: past
  the window the mask and the keys differ in length and every Inkling model raises. With only "hybrid" layers it
  runs and agrees with the forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from sweep_support import WRONG, holds, pinned, sweep_module

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

# The sweep's layer pattern (one sliding, one full layer) with a window the 12-token probes run past, and the sliding
# layers' own head sizes (64 heads of 128 by default) as small as the full layers' for speed.
SMALL = dict(sliding_window=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16)
FAST = {"cache": {"decode_steps": 3}}


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _run(model_type: str, check: str, **overrides):
    subject = from_module(small_model(model_type, **{**SMALL, **overrides}), name=model_type)
    return run_checks(subject, [check], RunOptions(seq_len=12, check_options=FAST)).check(check)


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_inkling_static_cache_offsets_its_relative_bias_and_inkling2_passes(model_type):
    """Inkling's static-cache decode differs from the full forward (1.5e-4 relative, the same in float64; dynamic
    cache exact); Inkling2, same layer pattern and relative bias, PASSes every path."""
    result = _run(model_type, "cache")
    if model_type == "inkling2_text":
        assert result.status is Status.PASS, result.summary
        return
    if not pinned(result, "inkling_text", "cache"):
        return
    paths = result.details["paths"]
    assert {name for name, p in paths.items() if p["status"] is Status.FAIL} == {
        "static/decode", "static/chunks", "static/chunked_prefill"}, result.summary
    assert all(p["status"] is Status.PASS for name, p in paths.items() if name.startswith("dynamic")), result.summary
    assert "float64" in result.summary, result.summary  # decided in float64: not rounding


def test_inkling_static_cache_query_offset_is_read_before_the_update_grows_it():
    """The mechanism, in plain transformers: the offset Inkling reads before `cache.update` is the static layer's
    length tensor, which the update grows in place, so the queries are placed one step (one chunk) too far."""
    model = small_model("inkling_text", **{**SMALL, "layer_types": ["hybrid", "hybrid"]})
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        model(ids[:, :10], cache=cache, use_cache=True)
        offset = cache.get_query_offset(1)
        assert int(offset) == 10
        model(ids[:, 10:], cache=cache, use_cache=True)
    assert int(offset) == (12 if holds("inkling_text", "cache") else 10)  # the value read earlier moved with the cache


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text", "inkling2_loop_text"])
def test_inkling_static_generate_past_the_sliding_window_crashes(model_type):
    """Up to transformers 5.24, generate(cache_implementation="static") past the sliding window raises in every
    Inkling model (the mask generate builds for a "hybrid_sliding" layer is as long as the full layers' cache): a
    FAIL naming the exception. 5.25 fixed the crash: Inkling2 then PASSes, and Inkling (v1) FAILs with wrong values,
    its static cache's relative bias one step off (the `cache` finding, now reached by generate too)."""
    result = _run(model_type, "generate")
    if pinned(result, model_type, "generate") and sweep_module().finding(model_type, "generate").kind != WRONG:
        assert "static/single crashed: RuntimeError" in result.summary, result.summary
        assert "must match the size of tensor b" in result.summary, result.summary


def test_inkling2_static_generate_with_only_full_hybrid_layers_passes():
    """The healthy sibling: the same Inkling2 with no "hybrid_sliding" layer generates with a static cache and
    agrees with the forward."""
    result = _run("inkling2_text", "generate", layer_types=["hybrid", "hybrid"])
    assert result.status is Status.PASS, result.summary


def test_inkling_static_generate_crash_shows_with_a_probe_the_window_holds():
    """A probe the window holds (4 + 3 tokens of 8): the prompt generated alone is stretched past the window (12
    tokens) and meets the crash; the padded batch keeps the probe length (4/3/2). The dynamic cache PASSes both."""
    subject = from_module(small_model("inkling_text", **SMALL), name="inkling_text")
    options = RunOptions(seq_len=4, check_options={"generate": {"new_tokens": 3}})
    result = run_checks(subject, ["generate"], options).check("generate")
    if not pinned(result, "inkling_text", "generate"):
        return
    assert result.details["alone_prompt_length"] == 12 and result.details["prompt_lengths"] == [4, 3, 2]
    runs = result.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.PASS and runs["dynamic/batch"]["status"] is Status.PASS
