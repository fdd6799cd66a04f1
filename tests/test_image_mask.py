"""`causal` on models whose mask reads token_type_ids (Gemma3 image blocks, PaliGemma prefix-LM): image tokens
that the model declares bidirectional must see each other, and no query may see a later key the declared mask
forbids. The plant drops token_type_ids from Gemma3's mask creation (image tokens restricted to causal
attention); its healthy twin passes."""

from __future__ import annotations

import warnings

import pytest

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import tiny_multimodal


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def _causal(model_type):
    subject = from_module(tiny_multimodal(model_type), name=model_type)
    return run_checks(subject, ["causal"], RunOptions(seq_len=12)).check("causal")


@pytest.mark.parametrize("model_type, span", [("gemma3", "image tokens 5-8"), ("paligemma", "prefix tokens 0-8")])
def test_healthy_bidirectional_groups_pass(model_type, span):
    check = _causal(model_type)
    assert check.status is Status.PASS, check.summary
    image = check.details["paths"]["image-token mask"]
    assert span in check.summary and image["blind_pairs"] == 0 and image["leaking_pairs"] == 0
    assert image["allowed_later_pairs"] > 0


def test_image_tokens_restricted_to_causal_fail(monkeypatch):
    from transformers.models.gemma3 import modeling_gemma3 as m

    def ignore_token_types(block_sequence_ids, **kwargs):  # the bug: token_type_ids never reach the mask
        return m.create_masks_for_generate(**kwargs)

    monkeypatch.setattr(m, "create_masks_for_vision_model", ignore_token_types)
    check = _causal("gemma3")
    assert check.status is Status.FAIL
    assert "image tokens 5-8 do not see each other although the model declares them bidirectional" in check.summary
    assert check.details["paths"]["image-token mask"]["blind_pairs"] == 6  # every later pair of the 4-token block


def test_text_seeing_later_image_fails(monkeypatch):
    from transformers.models.gemma3 import modeling_gemma3 as m

    real = m.get_block_sequence_ids_for_mask

    def everything_one_block(token_type_ids, device=None):  # the bug: text joins the image block
        return real(token_type_ids.clone().fill_(1), device=device)

    monkeypatch.setattr(m, "get_block_sequence_ids_for_mask", everything_one_block)
    check = _causal("gemma3")
    assert check.status is Status.FAIL
    assert "sees later text key" in check.summary or "sees later image key" in check.summary, check.summary


def test_text_only_models_are_not_probed_for_image_masks():
    from posdiag.testing import zoo

    check = run_checks(from_module(zoo.tiny_model("llama")), ["causal"], RunOptions(seq_len=12)).check("causal")
    assert check.status is Status.PASS and "image-token mask" not in check.details["paths"]
