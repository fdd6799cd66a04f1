"""`positions`: position_ids must be honoured (consistent permutation) and must matter (non-contiguous ids).

Healthy tiny models of every family PASS or SKIP with the reason (families that derive positions
inside); planted "positions rebuilt as arange" (a pre-hook on the rotary module / position table)
FAIL on Llama-, GPT-2-, GPT-NeoX- and BERT-like models, with the healthy twin passing.
"""

import plants_order
import pytest
import torch
from sweep_rows import exhaustive

from posdiag.api import _run_one
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=16, permutations=2)


def positions(model, options=OPTIONS):
    # _run_one: the API's per-check runner (error capture, forward count) without its gc pass.
    return _run_one(from_module(model), "positions", options)


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_every_family_passes_or_skips_with_reason(family):
    result = positions(zoo.tiny_model(family))
    if result.status is Status.NA:  # by design: the family takes no position_ids
        assert "position_ids" in result.summary and "derived inside" in result.summary
        assert zoo.position_kind(family) in ("alibi", "relative_bias") or zoo.model_kind(family) == "seq2seq"
        return
    assert result.status is Status.PASS, result.summary
    assert result.metrics["consistent_error"] <= result.metrics["tolerance"]
    assert result.metrics["ratio"] >= 100
    assert result.forward_passes == (2 if zoo.model_kind(family) == "causal" else 1)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bert"])
def test_positions_rebuilt_as_arange_fail(family):
    model = zoo.tiny_model(family)
    healthy = positions(model)
    assert healthy.status is Status.PASS, healthy.summary
    handles = plants_order.rebuild_arange(model, family)
    broken = positions(model)
    assert broken.status is Status.FAIL, broken.summary
    assert broken.summary.startswith("position_ids ignored")
    assert broken.metrics["residual"] == 0.0  # non-contiguous ids change nothing at all
    assert broken.metrics["consistent_error"] > 100 * broken.metrics["tolerance"]
    expected = "embeddings" if zoo.position_kind(family) == "learned" else "block 1"
    assert broken.details["consistent_breaks_at"] == expected
    for h in handles:
        h.remove()
    assert positions(model).status is Status.PASS


def test_rope_offset_alone_would_prove_nothing():
    """Why the variants are non-affine: a constant shift of every position id is invisible to RoPE."""
    from posdiag.model.probe import Row, run_rows
    from posdiag.model.tensors import relative_l2

    subject = from_module(zoo.tiny_model("llama"))
    ids = subject.sample_ids(1, 16, 0)[0]
    out = run_rows(subject, [Row(ids), Row(ids, positions=torch.arange(16) + 7)])
    assert relative_l2(out.final[1], out.final[0]) < 1e-5


def test_bfloat16_model_is_judged_as_run():
    result = positions(zoo.tiny_model("llama", dtype=torch.bfloat16))
    assert result.status is Status.PASS, result.summary


def test_report_names_floor_and_layers():
    result = positions(zoo.tiny_model("qwen2"))
    assert "jittered" in result.details["floor_source"]
    assert set(result.details["residual_per_variant"]) == {"gaps", "restart"}
    assert result.tables[0].rows[-1][0] == "block 2"
