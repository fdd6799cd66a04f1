"""Query scales that read the absolute position by design, beside Llama 4's (tests/test_llama4.py): Ministral 3 and
Mistral 4 declare Llama 4's scaling in rope_parameters (llama_4_scaling_beta), Mistral Large 4 learns one per head.
`shift` holds each at its value at the first positions and names it: a healthy model PASSes, saying so, where it
FAILed without the rows (measured: Ministral 3 with original_max_position_embeddings 32 broke between shift 20 and
21; Mistral Large 4 with its scale drawn non-zero broke at shift 1, 3.2e3x); q rotated but k not still FAILs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from plants_shift import keys_never_rotated

from posdiag.api import run_checks
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        yield
        transformers.utils.logging.set_verbosity(verbosity)


def _model(model_type: str) -> torch.nn.Module:
    config = small_config(model_type)
    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config, attn_implementation="eager").eval()
    if model_type == "ministral3":  # read at every forward: the scale changes from position 32 on, inside the ladder
        model.config.rope_parameters["original_max_position_embeddings"] = 32
    else:  # Mistral Large 4's init (scale 0) hides the term; a trained checkpoint's scale does not
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__.endswith("SoftmaxScaling"):
                    module.scale.copy_(torch.linspace(0.1, 0.3, module.scale.numel()))
    return model


def _shift(model, dtype):
    return run_checks(from_module(model.to(dtype)), ["shift"], RunOptions(seq_len=12)).check("shift")


def _moved_by_positions(model) -> float:
    ids = torch.randint(10, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(12)[None] + 64).logits
    return float((shifted - plain).norm() / plain.norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("model_type", "named"), [("ministral3", "llama_4_scaling_beta"),
                                                   ("mistral_large4", "softmax scaling")])
def test_healthy_model_passes_naming_its_term(model_type, named, dtype):
    model = _model(model_type)
    assert _moved_by_positions(model) > 1e-5  # the term acts within the ladder: a shift moves the outputs
    result = _shift(model, dtype)
    assert result.status is Status.PASS, result.summary
    assert named in result.summary and "absolute by design, so judged with it held" in result.summary
    assert _moved_by_positions(model.float()) > 1e-5  # the hold is given back


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_keys_never_rotated_still_fails(dtype):
    result = _shift(keys_never_rotated(_model("ministral3")), dtype)
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["breaks_at"] == 1
