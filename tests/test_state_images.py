"""`state` with images: an image prompt (or a padded batch holding one) then a text prompt decoded in a hand-written
loop, with and without position_ids, against the same loop on a fresh model. Plants on tiny Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (tests/plants_multimodal.py): rope_deltas kept from the image prompt, or reset only when the batch size
changes, FAIL naming the sequence; the twin that resets them at every prompt PASSes; stock transformers is the
findings table's row (benchmarks/sweep.py FINDINGS)."""

from __future__ import annotations

import plants_multimodal as plants
import pytest
from sweep_support import pinned

from posdiag import api
from posdiag.checks.state.images import IMAGE_SEQUENCES
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

pytestmark = pytest.mark.filterwarnings("ignore")
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v")


def _state(model, sequences=IMAGE_SEQUENCES):
    options = RunOptions(check_options={"state": {"sequences": list(sequences)}})
    return api.run_checks(from_module(model), ["state"], options).check("state")


def _rows(result) -> dict[str, str]:
    return {row[0]: row[1] for row in result.tables[0].rows}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rope_deltas_reset_at_every_prompt_pass(model_type):
    good = _state(plants.rope_deltas_reset(model_type))
    assert good.status is Status.PASS, good.summary
    assert _rows(good) == dict.fromkeys(IMAGE_SEQUENCES, "pass")
    assert good.summary.startswith("the same input gives the same output after every history (text after an image, "
                                   "text after an image, position_ids, prompt after an image batch; max error 0 ")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rope_deltas_kept_from_an_image_prompt_fail_naming_the_sequence(model_type):
    bad = _state(plants.rope_deltas_kept(model_type))
    assert bad.status is Status.FAIL, bad.summary
    assert _rows(bad) == {"text after an image": "fail", "text after an image, position_ids": "pass",
                          "prompt after an image batch": "fail"}
    assert bad.summary.startswith("text after an image: after a plain forward of an image prompt (2 images), a "
                                  "8-token text prompt decoded 6 tokens in a hand-written loop (cache passed, no "
                                  "position_ids): the output differs from a fresh model's by "), bad.summary
    assert "a bug (it does not shrink with precision)): state kept from the earlier calls: model.kept_deltas None " \
           "-> -5" in bad.summary
    assert "prompt after an image batch: after a plain forward of a left-padded batch of two rows (the image " \
           "prompt, a text row), a 8-token text prompt decoded in the same loop (no position_ids): the call crashed " \
           "(RuntimeError: " in bad.summary


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rope_deltas_reset_only_when_the_batch_size_changes_fail_the_same_size(model_type):
    bad = _state(plants.rope_deltas_reset_on_batch_size(model_type))
    assert bad.status is Status.FAIL, bad.summary
    assert _rows(bad) == {"text after an image": "fail", "text after an image, position_ids": "pass",
                          "prompt after an image batch": "pass"}  # the batch of two, then one row: reset
    assert bad.summary.startswith("text after an image: "), bad.summary


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stock_families_are_the_findings_row(model_type):
    """transformers 5.25 keeps rope_deltas on the model after an image prompt (FINDINGS: <type> state)."""
    result = _state(plants.healthy(model_type))
    if pinned(result, model_type, "state"):
        assert _rows(result)["text after an image, position_ids"] == "pass"  # the caller's positions are right
        assert "model.rope_deltas None -> -5" in result.summary


def test_a_tower_that_cannot_run_is_named_and_the_text_sequences_still_run():
    result = _state(plants.tower_that_cannot_run(), ("batch after batch", *IMAGE_SEQUENCES))
    assert result.status is Status.PASS, result.summary
    assert _rows(result) == {"batch after batch": "pass"}
    assert result.details["not_run"]["text after an image"] == (
        "the plain forward of its history raised RuntimeError: planted: the vision tower cannot run on this device")


def test_text_models_run_no_image_sequence_unless_asked_by_name():
    default = api.run_checks(from_module(zoo.tiny_model("llama")), ["state"],
                             RunOptions(check_options={"state": {"sequences": ["batch after batch"]}})).check("state")
    assert not any(n in default.details["not_run"] for n in IMAGE_SEQUENCES)
    everything = api.run_checks(from_module(zoo.tiny_model("llama")), ["state"]).check("state")
    assert not any(n in everything.details["not_run"] for n in IMAGE_SEQUENCES), everything.details["not_run"]
    asked = _state(zoo.tiny_model("llama"), ("batch after batch", "text after an image"))
    assert asked.details["not_run"] == {"text after an image": "no multimodal RoPE: no image prompt to leave "
                                                               "rope_deltas behind"}


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "glm46v", "glmga", "glm_ocr", "cosmos3_edge", "cosmos3_omni"])
def test_the_families_that_copy_the_numbering_keep_rope_deltas_too(model_type):
    """The sweep's tiny models of the types whose compute_3d_position_ids is Qwen2-VL's (FINDINGS: <type> state)."""
    from sweep_support import sweep_model

    pinned(_state(sweep_model(model_type), (IMAGE_SEQUENCES[0],)), model_type, "state")
