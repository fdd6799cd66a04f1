"""Models whose forward refuses text inputs alone: the complete text LM they hold is driven alone (and the header
says so), an encoder-decoder's LM-head decoder is built alone, and models with no such text LM say why."""

from __future__ import annotations

import pytest

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

CHECKS = ["shuffle", "causal"]


def _judged(subject) -> dict:
    report = run_checks(subject, CHECKS, RunOptions(seq_len=12))
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize(("model_type", "inner", "attribute", "cross"), [
    ("blip", "BlipTextLMHeadModel", "text_decoder", True),
    ("kosmos-2", "Kosmos2TextForCausalLM", "text_model", False),
    ("pix2struct", "Pix2StructTextModel", "decoder", True),
    ("vision-encoder-decoder", "BertLMHeadModel", "decoder", True),
])
def test_text_model_held_inside_is_driven_alone(model_type, inner, attribute, cross):
    subject = from_module(small_model(model_type), name=model_type)
    assert type(subject.model).__name__ == inner
    assert subject.kind == "causal"
    assert subject.tested.startswith(f"text model {inner} ({attribute}) of ")
    assert "driven alone" in subject.tested and "on text inputs" in subject.tested
    assert ("cross-attention" in subject.tested) is cross
    judged = _judged(subject)
    for name, check in judged.items():
        assert check.status in (Status.PASS, Status.SKIP), (name, check.summary)
    assert judged["causal"].status is Status.PASS


def test_whisper_is_built_as_its_decoder_with_lm_head():
    subject = from_module(small_model("whisper"), name="whisper")
    assert type(subject.model).__name__ == "WhisperForCausalLM" and subject.kind == "causal"
    assert subject.tested == ("text decoder WhisperForCausalLM alone; the encoder and the cross-attention to it "
                              "not tested")
    assert _judged(subject)["shuffle"].status is Status.PASS


@pytest.mark.parametrize(("model_type", "why"), [
    ("udop", "UdopStack (decoder) gives no logits"),
    ("pp_formulanet", "PPFormulaNetTextModel (model.decoder) gives no logits"),
    ("voxtral_realtime", "VoxtralRealtimeTextModel (model.language_model) TypeError"),
])
def test_model_without_a_text_lm_that_runs_alone_says_why(model_type, why):
    subject = from_module(small_model(model_type), name=model_type)
    assert "not drivable by text alone" in subject.tested and why in subject.tested
    with pytest.raises((TypeError, ValueError)):
        subject.forward(subject.sample_ids(1, 8, 0))


@pytest.mark.parametrize("model_type", ["xmod", "esm"])
def test_small_config_sets_what_every_forward_needs(model_type):
    subject = from_module(small_model(model_type), name=model_type)
    subject.forward(subject.sample_ids(1, 8, 0))
    assert _judged(subject)["shuffle"].status is Status.PASS
