"""shuffle on deep stacks: a model without positions FAILs, however many ulps its rounding reaches.

Without positions the consistent and the shuffled permutations are one function, so both residuals are rounding and
the consistent run restores nothing: it cannot serve as the floor. One ulp of float32 in its place was a false PASS
on exactly the bug the check exists for (a zoo Llama without positions, 64 layers x 256 hidden, initializer_range
0.3, 256 tokens: residual 4.2e-5 = 352x one ulp; 64 x 64 hidden: 143x, PASS; 32 layers x 512 tokens: 81x, WARN).
The float64 re-run decides: measured on position-less zoo models of six families at 32 layers x 256 tokens (Llama,
Qwen2, GPT-NeoX, Phi, GPT-2, OPT), the residual falls to 3e-15..2e-14 against a jittered-row floor of 6e-15..4e-14
(ratio 0.44-0.61), while each healthy twin keeps 0.75-1.4 (above 1e5x its floor).
The suite runs 64 x 64 for the false PASS the report found at 64 x 256: the same verdict read off one ulp (143x and
352x it), decided by the same float64 re-run (ratio 0.29 at 64 x 256), in 4 s of one core instead of 14.
"""

import pytest

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo


def deep_llama(layers: int, hidden: int, tokens: int, positions: bool):
    sizes = {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
             "initializer_range": 0.3, "max_position_embeddings": max(tokens, 128)}
    model = zoo.tiny_model("llama", **sizes)
    if not positions:
        zoo.remove_positions(model, "llama")
    return model


def shuffle(model, tokens):
    return run_checks(from_module(model), ["shuffle"], RunOptions(seq_len=tokens)).check("shuffle")


@pytest.fixture(scope="module", params=[(64, 64, 256), (32, 64, 512)], ids=["64x64-256tok", "32x64-512tok"])
def depth(request):
    return request.param


def test_deep_stack_without_positions_fails_in_float64(depth):
    layers, hidden, tokens = depth
    result = shuffle(deep_llama(layers, hidden, tokens, positions=False), tokens)
    assert result.status is Status.FAIL, result.summary
    assert "in float64" in result.summary and result.metrics["ratio"] < 10, result.summary
    assert result.metrics["residual"] < 1e-12  # rounding of float64, not of float32 kept inside
    assert result.details["floor_source"].startswith("float64 re-run")


def test_deep_healthy_twin_passes(depth):
    layers, hidden, tokens = depth
    result = shuffle(deep_llama(layers, hidden, tokens, positions=True), tokens)
    assert result.status is Status.PASS, result.summary
    assert result.metrics["ratio"] >= 100
