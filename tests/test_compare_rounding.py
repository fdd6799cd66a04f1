"""compare's PASS side with a real difference: every zoo family against its twin whose weights are rounded the other
way (plants_compare.rounded_twin: each weight one float32 ulp off at random). Against an identical copy (test_compare's
per-family rows) the error is exactly 0, which a compare that demanded bitwise equality would pass too; here the error
is nonzero and must sit within the floor. Measured: 1.1e-7 to 6.1e-7, 1.07x to 2.28x the floor over the 28 families
(~0.2 s each). The planted ports of test_compare still FAIL; a bfloat16 round trip of the weights is no rounding-level
twin in float32 and FAILs too, as position-uniform."""

import pytest
import torch
from plants_compare import copy_of, rounded_twin
from sweep_rows import exhaustive

from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.ports.layers import compare_subjects
from posdiag.results import Status
from posdiag.testing import zoo


def compared(ref, cand):
    return compare_subjects(from_module(ref), from_module(cand), RunOptions(seq_len=64)).result


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_a_twin_rounded_the_other_way_passes_with_a_nonzero_error(family):
    # fails against a compare that demands bitwise agreement (a floor from an identical run, 0, unclamped) or an atol
    # below float32's rounding; an identical copy passes both
    ref = zoo.tiny_model(family)
    result = compared(ref, rounded_twin(ref))
    assert result.status is Status.PASS, result.summary
    assert result.metrics["error"] > 0 and 0 < result.metrics["ratio"] <= 10, result.metrics
    assert "same model within rounding" in result.summary


def test_weights_rounded_to_bfloat16_are_other_weights_in_float32():
    """Rounded to bfloat16 and loaded back into float32: a relative change near 2e-3 per weight, 1e4x float32's
    rounding. compare judges float32 runs, so this is a difference, at every position alike (measured 1.6e4x the
    floor from the embeddings on); a bfloat16 candidate is judged at its own floor (test_compare's bf16 twin)."""
    ref = zoo.tiny_model("llama")
    cand = copy_of(ref)
    with torch.no_grad():
        for param in cand.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    result = compared(ref, cand)
    assert result.status is Status.FAIL and result.details["pattern"] == "position-uniform", result.summary
    assert result.details["first_layer"] == "embeddings"
