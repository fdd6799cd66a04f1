"""`causal`: editing token j must move no output before j, for every j, on both mask paths.

Planted: each query sees the next token (Llama, GPT-2, Qwen2 sliding/hybrid, T5 decoder), and a
relative-position leak (query i sees key i + 6, as a mis-gathered relative mask diagonal) on
Llama, GPT-2 and T5 — found from the first leaking pair, not from a suffix. Healthy twins pass.
"""

import plants_order
import pytest
from sweep_rows import exhaustive

from posdiag.api import _run_one
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=16)


def causal(model, options=OPTIONS):
    # _run_one: the API's per-check runner (error capture, forward count) without its gc pass.
    return _run_one(from_module(model), "causal", options)


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_every_family_passes_or_skips_with_reason(family):
    result = causal(zoo.tiny_model(family))
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.NA and "bidirectional" in result.summary
        return
    assert result.status is Status.PASS, result.summary
    assert set(result.details["paths"]) == {"default mask", "explicit mask"}
    assert result.metrics["leak"] <= result.metrics["tolerance"]
    assert result.forward_passes == 2


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "t5"])
def test_next_token_visible_fails_with_first_pair(family):
    model = zoo.tiny_model(family)
    assert causal(model).status is Status.PASS
    handles = plants_order.open_future(model, family, distance=1)
    result = causal(model)
    assert result.status is Status.FAIL, result.summary
    for path in ("default mask", "explicit mask"):
        found = result.details["paths"][path]
        assert found["first_leak"] == (0, 1)
        assert found["leak_distances"][0] == 1
    assert result.summary.startswith("query 0 sees key 1")
    assert result.metrics["ratio"] > 1000
    for h in handles:
        h.remove()
    assert causal(model).status is Status.PASS


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_relative_leak_far_back_is_found(family):
    """Key i+6 visible to query i: a suffix-only edit from position 12 on would see nothing before 12
    except through queries 6..11; the full sweep names the first pair, (0, 6)."""
    model = zoo.tiny_model(family)
    plants_order.open_future(model, family, distance=6)
    result = causal(model)
    assert result.status is Status.FAIL
    found = result.details["paths"]["default mask"]
    assert found["first_leak"] == (0, 6)
    assert 6 in found["leak_distances"] and min(found["leak_distances"]) == 6
    assert "query 0 sees key 6" in result.summary


def test_table_lists_both_paths():
    result = causal(zoo.tiny_model("gpt_neo"))
    assert [row[0] for row in result.tables[0].rows] == ["default mask", "explicit mask"]


def test_the_default_length_typed_or_not_sweeps_the_same():
    """--seq-len 64 is the documented default: typed, it sweeps what the default sweeps (the first 32 positions, the
    `positions` setting), not 64; a longer sweep is that setting's."""
    model = zoo.tiny_model("llama")
    default, typed = causal(model, RunOptions()), causal(model, RunOptions(seq_len=64))
    assert default.details["seq_len"] == typed.details["seq_len"] == 32
    assert default.summary == typed.summary and default.metrics == typed.metrics
    wider = causal(model, RunOptions(seq_len=64, check_options={"causal": {"positions": 48}}))
    assert wider.details["seq_len"] == 48 and wider.status is Status.PASS, wider.summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_faint_leak_under_the_bfloat16_floor_fails_decided_in_float32(family):
    """Query i sees key i + 1 with a -8 score bias: 5e-4 of the output, under bfloat16's jittered floor (~0.1), so as
    run it reads 'no leak'; the stored weights held in float32 show it far above float32's floor and name the pair.
    The healthy twin PASSes, its paths also read once as stored."""
    import torch
    from decided import assert_decided_in_float32

    healthy = causal(zoo.tiny_model(family, dtype=torch.bfloat16))
    assert healthy.status is Status.PASS, healthy.summary
    assert_decided_in_float32(healthy)
    model = zoo.tiny_model(family, dtype=torch.bfloat16)
    plants_order.open_future(model, family, distance=1, bias=-8.0)
    result = causal(model)
    assert result.status is Status.FAIL, result.summary
    assert "query 0 sees key 1" in result.summary and result.details["dtypes"]["decided_in"] == "float32"
