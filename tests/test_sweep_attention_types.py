"""Layer types that are attention under another name, and convolutions in a tower the text never reaches, must not be
read as recurrent mixers of the language model: that read turned the consistent permutation off and left `rope`
unable to observe the applied rotation (a WARN on every DSA model and on VibeVoice-ASR)."""

from __future__ import annotations

import warnings

import pytest
import transformers

from posdiag.api import run_checks
from posdiag.model.introspect import recurrent_mixers
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config, small_model


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


@pytest.mark.parametrize("model_type, towers", [
    ("granite_speech", "encoder_config and projector_config"),
    ("vibevoice_asr", "acoustic_tokenizer_encoder_config and semantic_tokenizer_encoder_config"),
    ("llava", "vision tower"),
])
def test_any_sub_config_next_to_the_text_config_is_a_tower_not_tested(model_type, towers):
    from types import SimpleNamespace

    from posdiag.model.towers import tested_tower

    model = SimpleNamespace(config=small_config(model_type))
    assert tested_tower(model) == f"language model of SimpleNamespace; {towers} not tested"


def test_text_models_and_encoder_decoders_have_no_towers():
    from types import SimpleNamespace

    from posdiag.model.towers import tested_tower

    for model_type in ("llama", "t5", "encoder-decoder"):
        assert tested_tower(SimpleNamespace(config=small_config(model_type))) == "", model_type


def test_a_towers_convolutions_are_no_mixers_of_the_language_model():
    """VibeVoice-ASR's acoustic tokenizer holds causal convolutions; searched in the whole model they were taken for
    recurrent mixers of its Qwen2 language model, and `rope` could not observe the applied rotation (a WARN)."""
    config = small_config("vibevoice_asr")
    for tower in (config.acoustic_tokenizer_encoder_config, config.semantic_tokenizer_encoder_config):
        tower.num_filters, tower.depths = 2, [1] * len(tower.depths)  # its 32 filters doubling 6 times: 686M weights
    subject = from_module(small_model("vibevoice_asr", config=config), name="vibevoice_asr")
    assert recurrent_mixers(subject.model) and not recurrent_mixers(subject.language_model)
    report = run_checks(subject, ["rope", "kernels"], RunOptions(seq_len=12))
    assert report.check("rope").status is Status.PASS, report.check("rope").summary
    # its tokenizer refuses SDPA; the language model the checks drive switches alone (a SKIP before)
    assert report.check("kernels").status is Status.PASS, report.check("kernels").summary
