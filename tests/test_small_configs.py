"""small_config keeps each shrunk config consistent with itself, so that the sweep can build and run the model."""

from __future__ import annotations

import pytest
import torch

from posdiag.testing.multimodal import SPECIAL_TOKENS, TEXT_SIZES, small_config
from posdiag.testing.shrink_rules import listed_sizes

VOCAB = TEXT_SIZES["vocab_size"]


def _forward(model_type: str) -> torch.Tensor:
    """The sweep's build and plain forward of the small config."""
    from posdiag.model.classes import auto_class
    from posdiag.model.families import family_for
    from posdiag.model.loading import from_module

    config = small_config(model_type)
    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config, attn_implementation="eager").eval()
    subject = from_module(model, name=model_type)
    return subject.forward(subject.sample_ids(1, 8, 0)).final


@pytest.mark.parametrize("model_type", ["phi3", "marian"])
def test_special_ids_move_inside_the_small_vocabulary(model_type):
    config = small_config(model_type)
    ids = [getattr(config, f"{k}_token_id", None) for k in ("pad", "bos", "eos", "decoder_start")]
    assert all(i is None or 0 <= i < VOCAB - len(SPECIAL_TOKENS) or i < 4 for i in ids)
    assert config.pad_token_id is not None and config.pad_token_id < VOCAB


def test_equal_special_ids_stay_equal_and_lists_are_moved():
    marian = small_config("marian")  # decoder start is the padding id in the default
    assert marian.decoder_start_token_id == marian.pad_token_id < VOCAB
    assert marian.decoder_vocab_size == VOCAB
    glm = small_config("glm")  # eos is a list whose first id is the padding id
    assert glm.eos_token_id[0] == glm.pad_token_id and all(i < VOCAB for i in glm.eos_token_id)


def test_special_ids_agree_between_the_text_and_the_top_level_config():
    config = small_config("granite_docling")
    assert config.pad_token_id == config.text_config.pad_token_id < VOCAB


def test_ids_already_inside_the_vocabulary_are_kept():
    assert small_config("phi3").bos_token_id == 1  # the default's, inside 256


def test_latent_attention_sizes_are_consistent():
    config = small_config("deepseek_v3")
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.head_dim == config.qk_rope_head_dim  # DeepSeek's head_dim is the rotated part
    assert config.num_key_value_heads == config.num_attention_heads
    assert (config.n_routed_experts, config.first_k_dense_replace, config.n_group, config.topk_group) == (4, 1, 2, 1)
    mistral4 = small_config("mistral4")  # Mistral 4's head_dim is the whole query/key head
    assert mistral4.head_dim == mistral4.qk_nope_head_dim + mistral4.qk_rope_head_dim
    assert small_config("glm5_next").text_config.qk_rope_head_dim == 0  # none in the default


def test_grouped_heads_kept_where_the_model_takes_them():
    assert small_config("llama").num_key_value_heads == 2
    assert small_config("esmc").num_key_value_heads == small_config("esmc").num_attention_heads
    ocr = small_config("unlimited_ocr").text_config  # its eager attention never repeats key/value heads
    assert ocr.num_key_value_heads == ocr.num_attention_heads


def test_mamba2_heads_span_the_expanded_width():
    config = small_config("mamba2")
    assert config.num_heads * config.head_dim == config.expand * config.hidden_size
    assert config.num_heads % config.n_groups == 0


def test_layer_patterns_cover_the_small_layer_count():
    neo = small_config("gpt_neo")
    assert len(neo.attention_layers) == neo.num_layers and set(neo.attention_layers) == {"global", "local"}
    zamba2 = small_config("zamba2")  # layer types under an alias (layers_block_type)
    assert len(zamba2.layers_block_type) == zamba2.num_hidden_layers
    assert set(zamba2.layers_block_type) == {"linear_attention", "hybrid"}


def test_single_expert_routing_and_listed_sizes_are_kept():
    assert small_config("zaya").num_experts_per_tok == 1
    assert listed_sizes({"image_size": [378, 378], "patch_size": 14}, {"image_size": 28, "patch_size": 14}) == {
        "image_size": [28, 28]}  # Molmo2's tower takes [height, width]
    assert small_config("inkling2").vision_config.text_hidden_size == TEXT_SIZES["hidden_size"]


@pytest.mark.parametrize("model_type", ["phi3", "deepseek_v3", "mamba2", "gpt_neo", "zamba2"])
def test_small_model_builds_and_runs_a_plain_forward(model_type):
    hidden = _forward(model_type)
    assert hidden.shape[:2] == (1, 8) and torch.isfinite(hidden).all()
