"""generate: greedy generate() (single prompt and a padded batch; default and static cache)
must agree with the teacher-forced forward of each row alone. Healthy zoo families PASS or
SKIP with a reason; planted generation/decode position bugs FAIL with the row and step named."""

import plants_cache as plants
import pytest
from sweep_rows import CORE_FAMILIES, rotating
from test_cache import STATIC_CACHE_BUGS

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=10, check_options={"generate": {"new_tokens": 3}})


def generate(model):
    return run_checks(from_module(model), ["generate"], OPTIONS).check("generate")


@pytest.mark.parametrize("family", rotating(zoo.FAMILIES, CORE_FAMILIES | set(STATIC_CACHE_BUGS)))
def test_healthy_family_passes_or_skips(family):
    result = generate(zoo.tiny_model(family))
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.NA and result.summary
        return
    if family in STATIC_CACHE_BUGS:  # upstream bugs on generate(cache_implementation="static")
        assert result.status is Status.FAIL, result.summary
        assert result.summary.startswith("static/") and STATIC_CACHE_BUGS[family] in result.summary
        runs = result.details["runs"]
        assert runs["dynamic/single"]["status"] is Status.PASS and runs["dynamic/batch"]["status"] is Status.PASS
        return
    assert result.status is Status.PASS, result.summary
    assert result.metrics["ratio"] <= 10
    assert result.metrics["first_step_error"] <= result.metrics["tolerance"]
    assert result.metrics["runs_judged"] == 4  # dynamic and static, single and batch: static runs on every model


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_decode_positions_numbered_differently_fail(family):
    result = generate(plants.generation_positions_off_by_one(zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    assert "dynamic/single: row 0 step 1" in result.summary  # step 0 (the prefill) is still right
    assert result.metrics["ratio"] > 1e3


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_padding_ignored_in_generation_positions_fails_on_the_batch_only(family):
    result = generate(plants.generation_positions_ignore_padding(zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    runs = result.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.PASS
    assert runs["dynamic/batch"]["status"] is Status.FAIL
    assert runs["dynamic/batch"]["first_difference"].startswith("row 1 step 0")


def test_padding_shift_is_invisible_to_rope():
    """A constant per-row offset does not change a RoPE model's output: honest PASS, not a miss."""
    assert generate(plants.generation_positions_ignore_padding(zoo.tiny_model("llama"))).status is Status.PASS


def test_forward_decode_bug_also_breaks_generation():
    result = generate(plants.rotate_decode_off_by_one(zoo.tiny_model("gpt2")))
    assert result.status is Status.FAIL and "step 1" in result.summary
