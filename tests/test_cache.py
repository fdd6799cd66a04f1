"""cache: KV-cache decoding (decode steps, multi-token chunks, chunked prefill; dynamic and
static caches) must reproduce one full forward. Healthy zoo families PASS or SKIP with a
reason; planted decode-position and buffer-length bugs FAIL with the step named."""

import pytest

from posdiag.testing import zoo
from posdiag.api import run_checks
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.model.loading import from_module

import plants_cache as plants

OPTIONS = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 4}})


def cache(model):
    return run_checks(from_module(model), ["cache"], OPTIONS).check("cache")


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_healthy_family_passes_or_skips(family):
    result = cache(zoo.tiny_model(family))
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.SKIP and "encoder" in result.summary
        return
    assert result.status is Status.PASS, result.summary
    assert result.metrics["ratio"] <= 10
    assert result.metrics["noise_floor"] > 0
    if result.details["sliding_window"]:  # mistral, qwen2, gemma2/3, gpt_neo: run past the window
        assert result.details["seq_len"] > 2 * zoo.SLIDING_WINDOW
    if family == "gpt_neo":  # no static-cache support declared: skipped with the reason
        assert "_can_compile_fullgraph=False" in result.summary and result.metrics["paths_judged"] == 3
    elif family == "falcon_alibi":  # ALiBi over the query length crashes with a static cache
        assert "static cache not runnable" in result.summary
    elif family == "llama":
        assert result.metrics["paths_judged"] == 6 and "skipped" not in result.summary


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_decode_rotated_at_past_plus_one_fails(family):
    result = cache(plants.rotate_decode_off_by_one(zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["ratio"] > 1e3
    first = result.details["first_diverging"]
    assert first["path"] == "dynamic/decode" and first["step"].startswith("step 1 (position")
    # prefill and multi-token chunks are untouched by this bug
    assert result.details["paths"]["dynamic/chunks"]["status"] is Status.PASS


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_window_placed_by_buffer_length_fails_with_the_default_cache(family):
    result = cache(plants.window_by_buffer_length(zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    assert result.details["paths"]["dynamic/decode"]["status"] is Status.FAIL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_positions_from_static_buffer_length_fail(family):
    """A full-attention layer counting tokens by buffer length is right with DynamicCache
    (buffer = tokens) and wrong with StaticCache (buffer = max_cache_len): only static fails."""
    result = cache(plants.window_by_buffer_length(zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    paths = result.details["paths"]
    assert paths["dynamic/decode"]["status"] is Status.PASS
    assert paths["static/decode"]["status"] is Status.FAIL


def test_generation_only_bug_is_not_a_cache_bug():
    """The forward pass is healthy when only generate's position numbering is planted."""
    assert cache(plants.generation_positions_off_by_one(zoo.tiny_model("llama"))).status is Status.PASS
