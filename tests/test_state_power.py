"""state's power: each sequence's fresh call again with every forward that continues a cache one position early
(posdiag.model.slip); its error against the fresh call is reported per sequence and read by verdict.powered. In
bfloat16 the float64 re-run decides every sequence (state's own plants FAIL there: tests/test_state.py)."""

import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=12, check_options={"state": {"sequences": ["multi-turn", "one request after a padded "
                                                                        "batch"]}})
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def state(model):
    return run_checks(from_module(model), ["state"], OPTIONS).check("state")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_sequence_carries_its_power(family, dtype):
    result = state(zoo.tiny_model(family, dtype=DTYPES[dtype]))
    assert result.status is Status.PASS, result.summary
    slips = {name: s["slip"] for name, s in result.details["sequences"].items()}
    assert all(slip is not None and slip > 0 for slip in slips.values()), slips
    if dtype == "float32":
        assert result.metrics["slip_ratio_min"] > 10, result.metrics
    else:
        assert "decided in float64" in result.summary or result.metrics["slip_ratio_min"] > 10

