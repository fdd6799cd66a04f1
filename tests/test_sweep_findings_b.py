"""Support-sweep rows on healthy default-init tiny models (posdiag.testing.multimodal.small_config): the small
config must stay consistent and representative, and the checks must read per-layer RoPE layouts as the model runs
them. Upstream findings are pinned next to a healthy sibling."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from posdiag.api import run_checks
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _subject(model_type: str, **overrides):
    config = small_config(model_type, **overrides)
    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config, attn_implementation="eager")
    return from_module(model.eval(), name=model_type)


def _status(subject, check: str, seq_len: int = 12):
    return run_checks(subject, [check], RunOptions(seq_len=seq_len)).check(check)


def test_small_config_head_emits_only_ids_of_the_embedding():
    # Inkling2's head has unpadded_vocab_size rows (fewer than the padded embedding); left at its default (200058)
    # the head emitted ids past the 256-row embedding and generate() fed them back: IndexError.
    for model_type in ("inkling2_text", "inkling2_loop_text"):
        config = small_config(model_type)
        assert config.unpadded_vocab_size <= config.vocab_size


@pytest.mark.slow  # ~15 s: generate() with dynamic and static caches through Inkling2's short convolutions
def test_inkling2_generate_passes():
    result = _status(_subject("inkling2_text", max_position_embeddings=32, n_routed_experts=4,
                               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16), "generate")
    assert result.status is Status.PASS, result.summary
