"""cache in half precision and its power: a one-position slip at the continuation must be able to FAIL.

A bfloat16 floor (the jittered full forward: 0.16 on the real SmolLM2) is coarse enough to pass a continuation numbered
one position early (0.09 there), so half-precision weights are decided held in float32 (exact), where the slip stands
thousands of floors up, and their paths run once more as stored. Every run measures its own power: the decode path's
first step fed with position_ids one early, reported beside the verdict. Where float64 decides a half-precision run
(the weights cannot be held in float32), it is read both ways (the powered() tests below)."""

import plants_cache as plants
import pytest
import torch
from decided import assert_healthy_with_power

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.verdict import FloorVerdict, judge_agreement, powered

OPTIONS = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 4}})
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache(model, options=OPTIONS):
    return run_checks(from_module(model), ["cache"], options).check("cache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_continuation_one_early_fails_and_healthy_twin_passes(family, dtype):
    assert_healthy_with_power(cache(zoo.tiny_model(family, dtype=DTYPES[dtype])), dtype)
    planted = cache(plants.continuation_one_early(zoo.tiny_model(family, dtype=DTYPES[dtype])))
    assert planted.status is Status.FAIL, planted.summary
    assert planted.details["first_diverging"]["path"].startswith(("dynamic/", "static/"))
    assert "position_ids" not in planted.details["first_diverging"]["path"]  # explicit ids are numbered right
    if dtype == "bfloat16":
        assert planted.details["dtypes"]["decided_in"] == "float32", planted.summary


def _pass(error=0.01, floor=0.16):
    return {"dynamic/decode": judge_agreement(error, floor, "bfloat16")}


def test_a_half_precision_pass_without_float64_and_without_power_is_inconclusive():
    verdicts, _ = powered(_pass(), 0.09, 0.16, "bfloat16", finer_decided=False, path="the decode path")
    v = verdicts["dynamic/decode"]
    assert v.status is Status.WARN and "bfloat16" in v.reason and "could not have failed" in v.reason


def test_power_stands_where_float64_decided_or_the_slip_shows():
    verdicts, clause = powered(_pass(), 0.09, 0.16, "bfloat16", finer_decided=True, path="the decode path")
    assert verdicts["dynamic/decode"].status is Status.PASS and "decided in float64" in clause
    verdicts, clause = powered(_pass(), 5.0, 0.16, "bfloat16", finer_decided=False, path="the decode path")
    assert verdicts["dynamic/decode"].status is Status.PASS and "bfloat16 floor" in clause
    verdicts, _ = powered(_pass(), None, 0.16, "bfloat16", finer_decided=False, path="the decode path")
    assert verdicts["dynamic/decode"].status is Status.PASS
    failing = {"x": FloorVerdict(Status.FAIL, 1.0, 0.01, 100.0, "bug")}
    assert powered(failing, 0.0, 0.16, "bfloat16", False, "x")[0]["x"].status is Status.FAIL


def test_real_smollm2_in_bfloat16_sees_a_continuation_one_early(smollm2_dir):
    """The real SmolLM2 stored in bfloat16: the plant that its bfloat16 floor alone passed (0.38x) FAILs, decided in
    float64; the healthy model PASSes."""
    from transformers import AutoModelForCausalLM

    options = RunOptions(seq_len=16, check_options={"cache": {"decode_steps": 2}})
    load = lambda: AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)  # noqa: E731
    healthy = cache(load(), options)
    assert healthy.status is Status.PASS, healthy.summary
    planted = cache(plants.continuation_one_early(load()), options)
    assert planted.status is Status.FAIL, planted.summary
    assert planted.details["arbitration"]["dtype"] == "float64"
