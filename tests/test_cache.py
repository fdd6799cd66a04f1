"""cache: KV-cache decoding (decode steps, multi-token chunks, chunked prefill; dynamic and
static caches) must reproduce one full forward. Healthy zoo families PASS or SKIP with a
reason; planted decode-position and buffer-length bugs FAIL with the step named."""

import plants_cache as plants
import pytest
from sweep_rows import CORE_FAMILIES, exhaustive
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 4}})


def cache(model):
    return run_checks(from_module(model), ["cache"], OPTIONS).check("cache")


# Upstream bugs of stock transformers on a path it accepts (a StaticCache, which generate() builds for
# cache_implementation="static" whatever the class declares), listed in the findings table (zoo:<family>): the check
# FAILs them where they hold on the installed transformers, naming the path, and PASSes where upstream fixed them.
# GPT-Neo's causal buffer is sliced by the key length, max_cache_len with a static cache; Falcon-ALiBi's bias is built
# over the query length, not the static key length.
STATIC_CACHE_BUGS = ("gpt_neo", "falcon_alibi")


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES, CORE_FAMILIES | set(STATIC_CACHE_BUGS)))
def test_healthy_family_passes_or_skips(family):
    model = zoo.tiny_model(family)
    result = cache(model)
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.NA and "encoder" in result.summary
        return
    if family in STATIC_CACHE_BUGS and pinned(result, f"zoo:{family}", "cache"):
        dynamic = {k: v for k, v in result.details["paths"].items() if k.startswith("dynamic/")}
        assert dynamic and all(v["status"] is Status.PASS for v in dynamic.values()), dynamic
        return
    assert result.status is Status.PASS, result.summary
    assert result.metrics["ratio"] <= 10
    assert result.metrics["noise_floor"] > 0
    if result.details["sliding_window"]:  # mistral, qwen2, gemma2/3: run past the window
        assert result.details["seq_len"] > 2 * zoo.SLIDING_WINDOW
    paths = result.details["paths"]
    assert {"dynamic/decode", "static/decode", "static/chunked_prefill"} <= set(paths)
    takes_ids = family_for(model.config).takes_position_ids and zoo.model_kind(family) == "causal"
    assert ("dynamic/decode+position_ids" in paths) == takes_ids


def test_static_cache_bug_is_in_float64_too():
    """GPT-Neo's static-cache error is a bug, not rounding: the float64 re-run keeps it."""
    result = cache(zoo.tiny_model("gpt_neo"))
    if not pinned(result, "zoo:gpt_neo", "cache"):
        return
    arbitration = result.details["arbitration"]
    assert arbitration["ran"] and arbitration["dtype"] == "float64"
    assert "a bug" in arbitration["decided"]["static/decode"]
    assert result.metrics["error_float64"] > 1e-3


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


def _asserting(model, when):
    """The model's forward raising AssertionError where when(ids, cache) holds (an instance attribute)."""
    original = model.forward

    def forward(*args, **kwargs):
        ids, past = kwargs.get("input_ids"), kwargs.get("cache", kwargs.get("past_key_values"))
        cached = past is not None and past.get_seq_length() > 0
        assert not (ids is not None and cached and when(ids)), "planted: this cache path is not supported"
        return original(*args, **kwargs)

    model.forward = forward
    return model


def test_an_assertion_on_the_one_token_decode_is_a_fail_naming_it():
    """Every user's decode path (generate(), a manual loop): the model's AssertionError there is a crash, a FAIL."""
    result = cache(_asserting(zoo.tiny_model("llama"), lambda ids: ids.shape[1] == 1))
    assert result.status is Status.FAIL, result.summary
    assert "AssertionError: planted: this cache path is not supported" in result.summary
    assert "crashed" in result.details["paths"]["dynamic/decode"]


def test_an_assertion_on_a_multi_token_schedule_is_a_refusal_not_judged():
    """posdiag's multi-token continuations against a cache: a precondition the model states, named, not judged."""
    result = cache(_asserting(zoo.tiny_model("llama"), lambda ids: ids.shape[1] > 1))
    assert result.status is Status.PASS, result.summary
    assert "not judged, the model refuses them" in result.summary and "dynamic/chunks" in result.summary
    assert result.details["paths"]["dynamic/chunks"]["status"] is Status.SKIP
