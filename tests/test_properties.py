"""Property-based: random small-but-valid configs never crash posdiag, and healthy models never FAIL.

Families, head dims, kv heads, RoPE types and parameters, sliding windows and probe lengths are
drawn by hypothesis; each example is a real tiny model built from its config.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posdiag import checks
from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

HEALTHY_NEVER_FAIL = ["shuffle", "shift", "positions", "batch", "causal"]


@st.composite
def rope_configs(draw):
    """Configs transformers builds: each draw is valid by construction, so no example is discarded and a
    build failure fails the test. The one exclusion, measured: dynamic NTK over a single rotary pair (head_dim
    8 x partial_rotary_factor 0.25 = 2 rotary dims) divides by zero in transformers' own dynamic frequency
    update (exponent dim / (dim - 2)), so dynamic draws keep at least two pairs."""
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "gpt_neox", "olmo2"]))
    heads = draw(st.sampled_from([2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    kv = draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0]))
    rope_type = draw(st.sampled_from(["default", "linear", "dynamic", "yarn"]))
    params = {"rope_type": rope_type, "rope_theta": draw(st.sampled_from([100.0, 1e4, 5e5]))}
    if rope_type != "default":
        params["factor"] = draw(st.sampled_from([2.0, 4.0]))
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = 64
    overrides = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "rope_parameters": params}
    if family not in ("gpt_neox", "phi"):
        overrides["num_key_value_heads"] = kv
    if family in ("mistral", "qwen3", "gemma"):
        overrides["head_dim"] = head_dim
    if family in ("mistral", "qwen2"):
        overrides["sliding_window"] = draw(st.sampled_from([4, 8, 16]))
    if family in ("gpt_neox", "phi"):
        factors = [f for f in (0.25, 0.5, 1.0) if rope_type != "dynamic" or head_dim * f >= 4]
        params["partial_rotary_factor"] = draw(st.sampled_from(factors))
    seq_len = draw(st.sampled_from([8, 16, 24]))
    return family, overrides, seq_len


@settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=rope_configs(), seed=st.integers(0, 3))
def test_random_rope_configs_never_fail_healthy(case, seed):
    family, overrides, seq_len = case
    model = zoo.tiny_model(family, seed=seed, **overrides)  # a config transformers rejects fails here, visibly
    names = [n for n in HEALTHY_NEVER_FAIL if n in checks.available()]
    report = run_checks(from_module(model), names, RunOptions(seq_len=seq_len, seed=seed))
    for result in report.checks:
        assert result.status is Status.PASS, (
            f"{family} {overrides}: {result.name}: {result.status.value}: {result.summary}")


def test_dynamic_rope_over_one_rotary_pair_is_rejected_by_transformers():
    """The exclusion above, kept honest: if transformers starts building it, the strategy should draw it."""
    with pytest.raises(ZeroDivisionError):
        zoo.tiny_model("gpt_neox", hidden_size=16, num_attention_heads=2,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0,
                                        "partial_rotary_factor": 0.25})


@settings(max_examples=6, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["gpt2", "opt", "bert", "bloom", "t5", "bart"]), seq_len=st.sampled_from([6, 12, 20]),
       seed=st.integers(0, 3))
def test_random_other_families_shuffle(family, seq_len, seed):
    model = zoo.tiny_model(family, seed=seed)
    result = run_checks(from_module(model), ["shuffle"], RunOptions(seq_len=seq_len, seed=seed)).check("shuffle")
    assert result.status is Status.PASS, result.summary
    zoo.remove_positions(model, family)
    broken = run_checks(from_module(model), ["shuffle"], RunOptions(seq_len=seq_len, seed=seed)).check("shuffle")
    assert broken.status is Status.FAIL, broken.summary
