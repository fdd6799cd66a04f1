"""Models whose forward refuses text inputs alone: the complete text LM they hold is driven alone (and the header
says so), an encoder-decoder's LM-head decoder is built alone, and models with no such text LM say why."""

from __future__ import annotations

import pytest
from sweep_support import pinned

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
        assert check.status in (Status.PASS, Status.SKIP, Status.NA), (name, check.summary)
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


# ------------------------------------------------------------------ upstream findings on the text models driven alone
GENERATE = RunOptions(seq_len=8, check_options={"generate": {"new_tokens": 3}})


@pytest.mark.parametrize("names_position_ids", [False, True])
def test_whisper_causal_lm_generate_numbers_a_left_padded_row_from_its_padding(names_position_ids, monkeypatch):
    """WhisperForCausalLM.forward takes position_ids only through **kwargs, so generate() derives none and a
    left-padded row is numbered from its first padding column (1.01, the same in float64; the seq2seq class computes
    decoder_position_ids from the mask). The twin whose forward names position_ids gets them from generate() and
    PASSes."""
    from transformers.models.whisper import modeling_whisper

    if names_position_ids:
        original = modeling_whisper.WhisperForCausalLM.forward

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs)

        monkeypatch.setattr(modeling_whisper.WhisperForCausalLM, "forward", forward)
    subject = from_module(small_model("whisper"), name="whisper")
    result = run_checks(subject, ["generate"], GENERATE).check("generate")
    if names_position_ids:
        assert result.status is Status.PASS, result.summary
    elif pinned(result, "whisper", "generate"):
        assert "a bug" in result.summary


def test_kosmos2_text_model_static_cache_crashes_and_cached_steps_count_the_pads():
    """Kosmos2TextForCausalLM (Kosmos-2's text model, driven alone): every static-cache path crashes (its mask is
    expanded for the cache's length, not the keys'), the dynamic ones agree with the full forward; generate() on a
    left-padded batch counts the pads into the cached steps' positions (0.69, as Kosmos-2.5 does)."""
    subject = from_module(small_model("kosmos-2"), name="kosmos-2")
    report = run_checks(subject, ["cache", "generate"], GENERATE)
    cache, generate = report.check("cache"), report.check("generate")
    if pinned(cache, "kosmos-2", "cache"):
        paths = cache.details["paths"]
        assert all(p["status"] == "pass" for name, p in paths.items() if name.startswith("dynamic/")), paths
        assert all(p["status"] == "fail" for name, p in paths.items() if name.startswith("static/")), paths
    pinned(generate, "kosmos-2", "generate")
