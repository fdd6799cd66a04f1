"""The model kind comes from the checkpoint: an encoder family configured as a decoder (is_decoder=True, a
*ForCausalLM / *LMHeadModel head) is a causal decoder with a cache, so causal, cache and generate judge it.

Found this way in stock transformers 5.24: RobertaForCausalLM.generate() runs its positions from 0 while its
forward starts them at padding_idx + 1 (RoBERTa's offset), so the first generated token's logits differ from the
forward pass by 0.84 (relative). BERT, with no offset, agrees. The regression test expects that FAIL.
"""

import pytest
import torch
import transformers
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.results import Status

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=130)


def decoder(config_class, model_class, **overrides):
    torch.manual_seed(0)
    config = config_class(**{**SMALL, "architectures": [model_class.__name__], **overrides})
    return model_class(config)


@pytest.mark.parametrize("overrides, kind", [
    ({"is_decoder": True}, "causal"),
    ({"architectures": ["RobertaForCausalLM"]}, "causal"),
    ({"architectures": ["RobertaForMaskedLM"]}, "encoder"),
    ({}, "encoder"),
])
def test_kind_from_the_config(overrides, kind):
    config = transformers.RobertaConfig(**{**SMALL, **overrides})
    assert family_for(config).kind == kind


def test_decoder_configured_bert_is_judged_as_a_causal_decoder():
    report = run_checks(from_module(decoder(transformers.BertConfig, transformers.BertLMHeadModel, is_decoder=True)),
                        ["causal", "cache", "generate"])
    for name in ("causal", "cache", "generate"):
        assert report.check(name).status is Status.PASS, report.check(name).summary


def test_roberta_generate_positions_regression():
    """Upstream bug (transformers 5.24, 5.25; the findings table's roberta:is_decoder): generate() gives RoBERTa
    positions from 0, its forward from pad+1."""
    model = decoder(transformers.RobertaConfig, transformers.RobertaForCausalLM, is_decoder=True)
    report = run_checks(from_module(model), ["causal", "generate"])
    assert report.check("causal").status is Status.PASS, report.check("causal").summary
    generate = report.check("generate")
    if pinned(generate, "roberta:is_decoder", "generate"):
        assert "step 0" in generate.summary and generate.metrics["ratio"] > 1e4


def test_causal_head_without_is_decoder_sees_the_future():
    """A *ForCausalLM checkpoint of an encoder family without is_decoder=True attends bidirectionally
    (transformers only warns): as a causal LM it leaks the future, and `causal` says so."""
    model = decoder(transformers.BertConfig, transformers.BertLMHeadModel)
    result = run_checks(from_module(model), ["causal"]).check("causal")
    assert result.status is Status.FAIL and "sees key" in result.summary, result.summary
