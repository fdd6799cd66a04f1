"""A family posdiag has no quirk row for: an encoder-decoder with RoPE (T5Gemma, transformers 5.x).

posdiag hands encoder-decoder stacks no position_ids, so it must not build a "consistent"
permutation from ids the stacks never see (that made the encoder's floor equal its residual and
read as "position never entered" on a healthy model). Healthy: every check passes or skips with a
reason; rotary frequencies zeroed: shuffle fails on both stacks.
"""

from __future__ import annotations

import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.results import Status

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "T5GemmaForConditionalGeneration"):
    pytest.skip("this transformers has no T5Gemma", allow_module_level=True)


def t5gemma() -> torch.nn.Module:
    stack = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    config = transformers.T5GemmaConfig(encoder=stack, decoder=stack, vocab_size=256)
    return transformers.T5GemmaForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def healthy_report():
    return run_checks(from_module(t5gemma()), ["shuffle", "positions", "batch", "cache", "generate", "causal", "shift"])


def test_unknown_encoder_decoder_takes_no_position_ids():
    subject = from_module(t5gemma())
    assert subject.family.name == "t5gemma" and subject.kind == "seq2seq"
    assert not subject.family.takes_position_ids


def test_healthy_passes_or_skips_with_a_reason(healthy_report):
    for result in healthy_report.checks:  # measured: only `positions` does not apply (no position_ids to honour)
        assert result.status is (Status.NA if result.name == "positions" else Status.PASS), (result.name,
                                                                                               result.summary)
    assert "takes no position_ids" in healthy_report.check("positions").summary
    shuffle = healthy_report.check("shuffle")
    assert shuffle.status is Status.PASS and shuffle.summary.count("far above the noise floor") == 2


def test_generate_uses_the_decoder_start_generate_used(healthy_report):
    """T5Gemma's config has no decoder_start_token_id (it is in generation_config)."""
    assert healthy_report.check("generate").status is Status.PASS


def test_rotation_removed_fails_on_both_stacks():
    model = t5gemma()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("inv_freq"):
                buffer.zero_()
    result = run_checks(from_module(model), ["shuffle"]).check("shuffle")
    assert result.status is Status.FAIL
    assert result.summary.count("never entered") == 2 and "encoder" in result.summary and "decoder" in result.summary
