"""generate: greedy generate() (single prompt and a padded batch; default and static cache)
must agree with the teacher-forced forward of each row alone. Healthy zoo families PASS or
SKIP with a reason; planted generation/decode position bugs FAIL with the row and step named."""

import plants_cache as plants
import pytest
from sweep_rows import CORE_FAMILIES, exhaustive
from sweep_support import pinned
from test_cache import STATIC_CACHE_BUGS

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=10, check_options={"generate": {"new_tokens": 3}})


def generate(model):
    return run_checks(from_module(model), ["generate"], OPTIONS).check("generate")


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES, CORE_FAMILIES | set(STATIC_CACHE_BUGS)))
def test_healthy_family_passes_or_skips(family):
    result = generate(zoo.tiny_model(family))
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.NA and result.summary
        return
    if family in STATIC_CACHE_BUGS and pinned(result, f"zoo:{family}", "generate"):  # cache_implementation="static"
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


def _fed(model):
    """The shapes of the ids each call of the model feeds, in order, after the check ran: generate()'s own calls
    (those handed a cache) and the cache-free forwards."""
    shapes = {"generate": [], "forward": []}

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cached = kwargs.get("cache", kwargs.get("past_key_values")) is not None
        shapes["generate" if cached else "forward"].append(tuple(ids.shape))

    model.register_forward_pre_hook(count, with_kwargs=True)
    return shapes


WINDOW = 12
SHORT = RunOptions(seq_len=8, check_options={"generate": {"new_tokens": 3}})  # 8 + 3 stays within the window


def test_past_the_window_only_the_prompt_alone_is_stretched():
    """The prompt generated alone runs past the window (12 + 4 tokens); the padded batch keeps the probe length
    (8/6/4): its shorter rows never reach the window however long its first row is, so a stretched batch would
    multiply the tokens fed and test nothing more about the window."""
    model = zoo.tiny_model("mistral", sliding_window=WINDOW)
    shapes = _fed(model)
    result = run_checks(from_module(model), ["generate"], SHORT).check("generate")
    assert result.status is Status.PASS, result.summary
    assert "prompt 16 tokens alone, batch 8/6/4" in result.summary
    assert result.details["prompt_lengths"] == [8, 6, 4] and result.details["alone_prompt_length"] == WINDOW + 4
    generated, forwards = shapes["generate"], shapes["forward"]
    prefills = sorted(s for s in generated if s[1] > 1)
    # dynamic and static: alone, then the batch; and the power's slipped run (dynamic, alone)
    assert prefills == [(1, 16), (1, 16), (1, 16), (3, 8), (3, 8)], generated
    # each prefill, then 2 one-token steps per row: 2 caches x (16 + 2 alone, 3 x (8 + 2) batched), the slip 16 + 2
    assert sum(rows * width for rows, width in generated) == 2 * (18 + 30) + 18
    # the references (prompt + generated tokens but the last: 18, 10, 8, 6; both caches generate alike) in forwards
    # at most a quarter padding, and the floor's 2-token prefixes of the 4 prompts: one forward of the four
    # right-padded to 18 would feed 72; the slip's reference and floor prefixes once more (18 + 4 x 2)
    assert sum(rows * width for rows, width in forwards) <= (18 + 10 + 8 + 6) * 4 / 3 + 4 * 2 + 18 + 4 * 2, forwards


def test_window_bug_is_caught_by_the_prompt_alone_past_the_window():
    """The cache placing the window by its buffer length (mlx-lm #1673) shows only once decoding passes the window:
    the prompt alone FAILs with the dynamic cache while the batch at the probe length cannot see it."""
    result = run_checks(from_module(plants.window_by_buffer_length(zoo.tiny_model("mistral", sliding_window=WINDOW))),
                        ["generate"], SHORT).check("generate")
    assert result.status is Status.FAIL, result.summary
    runs = result.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.FAIL and runs["dynamic/batch"]["status"] is Status.PASS
    assert result.summary.startswith("dynamic/single: row 0 step 1"), result.summary
