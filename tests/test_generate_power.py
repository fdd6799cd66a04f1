"""generate in half precision and its power: the prompt alone generated again with every decode step one position
early (posdiag.model.slip) measures what a one-position slip does to the comparison; bfloat16 weights are decided held
in float32, so generate()'s positions one off FAIL although bfloat16's floor alone would have passed them."""

import plants_cache as plants
import pytest
import torch
from decided import assert_healthy_with_power

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=12)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def generate(model):
    return run_checks(from_module(model), ["generate"], OPTIONS).check("generate")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generation_positions_off_by_one_fail_and_the_healthy_twin_passes_with_its_power(family, dtype):
    healthy = generate(zoo.tiny_model(family, dtype=DTYPES[dtype]))
    assert_healthy_with_power(healthy, dtype)
    assert "one position early" in healthy.details["slip"]["how"]
    planted = generate(plants.generation_positions_off_by_one(zoo.tiny_model(family, dtype=DTYPES[dtype])))
    assert planted.status is Status.FAIL, planted.summary


def test_an_encoder_decoder_names_why_no_slip():
    result = generate(zoo.tiny_model("t5"))
    assert result.status is Status.PASS, result.summary
    assert result.details["slip"]["error"] is None and "not planted" in result.details["slip"]["how"]
