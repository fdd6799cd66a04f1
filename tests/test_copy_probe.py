"""The copy probe on the trained fixture: copies within its 32-token training length, not past it.

fixtures/rope-copy is a tiny Llama trained by fixtures/train_copy_model.py on [BOS] x x at lengths
<= 32 (max_position_embeddings = 32, the training length; training.json records the run).
"""

import json
from pathlib import Path

import pytest

from posdiag.model.loading import from_module, load_subject
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.tools import copy_probe

LENGTHS = [16, 32, 64, 128]
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "rope-copy"


@pytest.fixture(scope="module")
def trained():
    return load_subject(str(FIXTURE))


@pytest.fixture(scope="module")
def probed(trained):
    start = trained.forward_count
    result = copy_probe.run(trained, LENGTHS, seed=0)
    return result, trained.forward_count - start


def test_training_length_is_recorded_where_rope_reads_it(trained):
    record = json.loads((FIXTURE / "training.json").read_text())
    assert trained.max_positions == record["training_length"] == 32
    assert trained.config.rope_parameters["rope_type"] == "default"
    assert (FIXTURE / "model.safetensors").stat().st_size < 1_000_000


def test_copies_within_the_training_length_and_degrades_past_it(probed):
    result, forwards = probed
    assert forwards == len(LENGTHS)  # the rows of each length in one forward, no padding
    assert result.name == "copy" and result.status is Status.WARN, result.summary
    by_length = {p["length"]: p["accuracy"] for p in result.details["lengths"]}
    assert by_length[15] > 0.95 and by_length[31] > 0.95  # within 32 tokens: copies
    assert by_length[63] < 0.75 * by_length[31]  # past it: clearly lower
    assert by_length[127] < 0.5 * by_length[31] and by_length[127] < by_length[63]
    assert result.metrics["z_drop"] > 3
    assert result.metrics["degrades_from_length"] == 63
    assert "past the declared context of 32" in result.summary


def test_tables_show_accuracy_by_length_and_position(probed):
    result, _ = probed
    by_length, by_position = result.tables
    assert [row[0] for row in by_length.rows] == [15, 31, 63, 127]
    assert by_length.rows[-1][-1] == "beyond context" and by_length.rows[0][-1] == ""
    accuracies = [float(row[1]) for row in by_position.rows]
    assert accuracies[0] > 0.95 and accuracies[-1] < 0.3  # positions 0-15 vs 112-127


def test_same_seed_same_numbers(trained, probed):
    again = copy_probe.run(trained, LENGTHS, seed=0)
    assert again.details["lengths"] == probed[0].details["lengths"]


def test_within_context_only_passes(trained):
    result = copy_probe.run(trained, [16, 32], seed=1)
    assert result.status is Status.PASS and "no length beyond" in result.summary


def test_untrained_model_says_nothing():
    result = copy_probe.run(from_module(zoo.tiny_model("llama")), [16, 32, 64], seed=0)
    assert result.status is Status.SKIP and "does not copy" in result.summary


def test_encoder_is_skipped():
    result = copy_probe.run(from_module(zoo.tiny_model("bert")), [16, 32], seed=0)
    assert result.status is Status.SKIP and "causal" in result.summary
