"""The headline check on every family: healthy PASS, positions removed FAIL.

Each family is built tiny from a config (posdiag.testing.zoo) at transformers' default init (weak
position signal: ModernBERT's residual is ~5e-5) and at a strong init, in float32 and in
bfloat16 (judged as it runs, float64 re-runs deciding what bfloat16 rounding cannot). The
planted bug, zoo.remove_positions, removes position the way the family injects it (RoPE
rotation made the identity, tables zeroed, ALiBi bias zeroed, T5 buckets zeroed).
"""

import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions
from posdiag.results import Status
from posdiag.testing import zoo


def shuffle(model, **load):
    return run_checks(from_module(model, options=LoadOptions(**load)), ["shuffle"]).check("shuffle")


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_healthy_default_init_passes(family):
    result = shuffle(zoo.tiny_model(family))
    assert result.status is Status.PASS, result.summary
    assert result.metrics["ratio"] >= 100


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_positions_removed_fails(family):
    model = zoo.tiny_model(family, init="strong")
    zoo.remove_positions(model, family)
    result = shuffle(model)
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["ratio"] < 10


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "bloom", "bert", "t5"])
def test_strong_init_passes(family):
    assert shuffle(zoo.tiny_model(family, init="strong")).status is Status.PASS


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neo", "falcon_alibi", "modernbert", "bart"])
def test_bfloat16_is_judged_as_run(family):
    healthy = shuffle(zoo.tiny_model(family, dtype=torch.bfloat16))
    assert healthy.status is Status.PASS, healthy.summary
    broken = zoo.tiny_model(family, init="strong", dtype=torch.bfloat16)
    zoo.remove_positions(broken, family)
    assert shuffle(broken).status is Status.FAIL


def test_bfloat16_weights_are_decided_in_float32_then_float64():
    """bfloat16 weights are decided held in float32 (exactly: posdiag.half_precision); a residual near float32's
    rounding is inconclusive there, and the same rows re-run in float64 decide (a FAIL for the model without
    positions, a PASS for its healthy twin), never a WARN that shrugs."""
    broken = zoo.tiny_model("llama", dtype=torch.bfloat16)
    zoo.remove_positions(broken, "llama")
    result = shuffle(broken, upcast=False)
    assert result.status is Status.FAIL, result.summary
    assert "in float64 (inconclusive in float32" in result.summary, result.summary
    assert result.details["dtypes"]["decided_in"] == "float32"
    assert result.metrics["ratio"] < 10  # the float64 figures: outputs merely permute
    healthy = shuffle(zoo.tiny_model("llama", dtype=torch.bfloat16), upcast=False)
    assert healthy.status is Status.PASS, healthy.summary


def test_bfloat16_weights_the_float32_copy_refused_are_decided_in_float64(monkeypatch):
    """Where the weights cannot be held in float32 (a dispatched model, no memory), shuffle runs as stored and a
    residual near bfloat16's rounding is decided by the same rows in float64."""
    from posdiag.model import precision

    monkeypatch.setattr(precision, "float32_copy_refused", lambda subject: "no memory for it here")
    broken = zoo.tiny_model("llama", dtype=torch.bfloat16)
    zoo.remove_positions(broken, "llama")
    result = shuffle(broken, upcast=False)
    assert result.status is Status.FAIL, result.summary
    assert "in float64 (inconclusive in bfloat16" in result.summary, result.summary


def test_per_layer_table_shows_where_position_enters():
    rope = shuffle(zoo.tiny_model("llama"))
    assert rope.details["position_enters_at"] == "block 1"  # rotation happens inside attention
    learned = shuffle(zoo.tiny_model("gpt2"))
    assert learned.details["position_enters_at"] == "embeddings"
    rows = rope.tables[0].rows
    assert rows[0][0] == "embeddings" and float(rows[0][1]) == 0.0


def test_encoder_decoder_reports_both_stacks():
    model = zoo.tiny_model("bart", init="strong")
    model.model.decoder.embed_positions.weight.data.zero_()  # only the decoder loses positions
    result = shuffle(model)
    assert result.status is Status.FAIL
    assert result.details["stacks"]["encoder"]["reason"].startswith("position signal")
    assert "never entered" in result.details["stacks"]["decoder"]["reason"]
