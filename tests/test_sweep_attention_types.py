"""Layer types that are attention under another name must not be read as recurrent mixers: that read turned the
consistent permutation off and left `rope` unable to observe the applied rotation (a WARN on every DSA model)."""

from __future__ import annotations

import warnings

import pytest
import transformers

from posdiag.api import run_checks
from posdiag.model.introspect import recurrent_mixers
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def test_deepseek_sparse_attention_is_attention_and_its_rotation_is_judged():
    model = small_model("deepseek_v32")
    assert "indexed_attention" in set(model.config.layer_types)
    assert recurrent_mixers(model) == []
    report = run_checks(from_module(model, name="deepseek_v32"), ["positions", "rope"], RunOptions(seq_len=12))
    assert report.check("positions").status is Status.PASS, report.check("positions").summary
    assert "consistent permutation reproduces" in report.check("positions").summary
    assert report.check("rope").status is Status.PASS, report.check("rope").summary


def test_a_layer_type_that_is_no_attention_is_still_a_mixer():
    model = small_model("granitemoehybrid")  # linear_attention layers: Mamba2 mixers
    assert "linear_attention" in set(model.config.layer_types)
    assert recurrent_mixers(model) == ["GraniteMoeHybridMambaLayer"]
