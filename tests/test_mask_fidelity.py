"""No verdict on an unfaithful mask: each way a mask can be unfaithful gives an honest SKIP."""

from dataclasses import replace

import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.results import Status
from posdiag.testing import zoo


def shuffle_with_family(model, **family_changes):
    subject = from_module(model)
    subject.family = replace(subject.family, **family_changes)
    return run_checks(subject, ["shuffle"]).check("shuffle")


def test_hard_coded_causal_buffer_is_detected():
    """GPT-Neo without its injector: the mask can block but not open keys."""
    result = shuffle_with_family(zoo.tiny_model("gpt_neo", init="strong"), injector=None)
    assert result.status is Status.SKIP
    assert "does not reproduce" in result.summary or "hard-coded" in result.summary


def test_window_dropped_from_the_mask_is_detected():
    """Qwen2 given one 4D mask: the sliding layer loses its window, the default is not reproduced."""
    result = shuffle_with_family(zoo.tiny_model("qwen2"), mask_form="4d")
    assert result.status is Status.SKIP and "does not reproduce" in result.summary


def test_model_that_ignores_the_mask_is_detected():
    from fixtures.custom_model import TinySinusoidalLM

    class IgnoresMask(TinySinusoidalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return super().forward(input_ids, None, position_ids)

    torch.manual_seed(0)
    result = run_checks(from_module(IgnoresMask().eval()), ["shuffle"]).check("shuffle")
    assert result.status is Status.SKIP and "ignored" in result.summary


def test_faithful_mask_metrics_are_reported():
    result = run_checks(from_module(zoo.tiny_model("mistral")), ["shuffle"]).check("shuffle")
    assert result.status is Status.PASS
    assert result.metrics["mask_reproduces_default"] <= result.metrics["mask_tolerance"]
    assert result.metrics["mask_block_effect"] > 0 and result.metrics["mask_open_effect"] > 0
