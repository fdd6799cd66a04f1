"""Support-sweep rows of the Qwen omni thinkers and GLM-5-Next (posdiag.testing.multimodal.small_config): the small
config carries what the released checkpoints carry and stays small where the default is large; the upstream finding
on Qwen3-Omni's thinker is pinned next to its healthy sibling."""

from __future__ import annotations

import warnings

import pytest
import transformers
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config, small_model


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _result(model_type: str, check: str, seq_len: int = 12, **overrides):
    subject = from_module(small_model(model_type, **overrides), name=model_type)
    return run_checks(subject, [check], RunOptions(seq_len=seq_len)).check(check)


@pytest.mark.parametrize("model_type", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_omni_thinker_config_carries_vision_start_token_id(model_type):
    # The thinkers' get_rope_index reads config.vision_start_token_id on every call without position_ids; their
    # config classes declare no default (the talkers' do: 151652), the released checkpoints and transformers' own
    # tests set it. Without it, batch raised AttributeError and generate() crashed.
    assert not hasattr(transformers.AutoConfig.for_model(model_type), "vision_start_token_id")
    assert small_config(model_type, image_tokens_in_vocab=False).vision_start_token_id == 151652
    moved = small_config(model_type)  # the default: placeholders inside the small vocabulary
    assert moved.vision_start_token_id < moved.get_text_config().vocab_size


def test_placeholder_ids_a_config_declares_are_kept():
    assert small_config("qwen2_vl", image_tokens_in_vocab=False).vision_start_token_id == 151652


@pytest.mark.parametrize("model_type", ["glm4v", "hunyuan_vl", "qwen2_5_omni_thinker"])
def test_placeholder_and_delimiter_ids_move_inside_the_small_vocabulary(model_type):
    # The decode-after-image probe needs the image token inside the embedding (it was 151655 of 256 rows on every
    # Qwen-VL type), and the start/end delimiters the model reads beside it: GLM-4V's image/video start and end ids,
    # HunYuan-VL's im_start_id / im_end_id, the omni thinkers' audio ids. Distinct ids stay distinct.
    config = small_config(model_type)
    vocab = config.get_text_config().vocab_size
    ids = {k: v for k, v in config.to_dict().items() if k.endswith(("token_id", "token_index", "_id"))
           and k.startswith(("image", "video", "vision", "audio", "im_")) and isinstance(v, int)}
    assert ids and all(0 <= v < vocab for v in ids.values()), ids
    assert len(set(ids.values())) == len(ids), ids
    kept = small_config(model_type, image_tokens_in_vocab=False)
    assert any(getattr(kept, k) >= vocab for k in ids)


@pytest.mark.parametrize("model_type", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_omni_thinker_batch_passes(model_type):
    result = _result(model_type, "batch")
    assert result.status is Status.PASS, result.summary


def test_qwen2_5_omni_thinker_generate_passes():
    result = _result("qwen2_5_omni_thinker", "generate")
    assert result.status is Status.PASS, result.summary


@pytest.mark.parametrize("check", ["cache", "generate"])
def test_qwen3_omni_thinker_cache_evicts_past_a_window_its_attention_ignores(check):
    # Upstream finding: Qwen3OmniMoeTextConfig documents sliding_window ("None: no sliding window"); the thinker's
    # attention hard-codes no window (full causal mask), while the DynamicCache / StaticCache built from the config
    # keep only the last window - 1 keys. Decoding past a window of 8 differs from the full forward by 0.65 (cache) and
    # 0.39 (generate), the same in float32 and float64; 0.354 in a plain transformers reproduction.
    result = _result("qwen3_omni_moe_thinker", check, sliding_window=8)
    if pinned(result, "qwen3_omni_moe_thinker:sliding_window", check):
        assert "float64: a bug" in result.summary, result.summary


@pytest.mark.parametrize("check", ["cache", "generate"])
def test_qwen3_omni_thinker_without_a_window_passes(check):
    # The healthy sibling: the default (no window), the same lengths.
    result = _result("qwen3_omni_moe_thinker", check, sliding_window=None)
    assert result.status is Status.PASS, result.summary


def test_linear_attention_mixers_follow_the_small_attention():
    # GLM-5-Next's default 64 heads of 128 dims (a 8192-wide mixer on the 64-wide small model): its chunked kernel's
    # per-channel decay mask took 2.3 GB for the causal check's 17 rows, past the sweep's 6 GB address space.
    text = small_config("glm5_next").text_config
    assert (text.linear_num_heads, text.linear_head_dim) == (4, 16)
    qwen = small_config("qwen3_next")  # gated delta rule: value heads keep their share of key heads (32 of 16)
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_key_head_dim,
            qwen.linear_value_head_dim) == (2, 4, 16, 16)
    olmo = small_config("olmo_hybrid")  # derived from the attention sizes by its own config: left to it
    assert (olmo.linear_num_key_heads, olmo.linear_key_head_dim) == (4, 12)


def test_glm5_next_causal_passes():
    result = _result("glm5_next", "causal")
    assert result.status is Status.PASS, result.summary


def test_batch_fails_naming_a_crash_of_the_models_own_defaults_path():
    # The model's own forward raising on a call transformers accepts (a padded batch without position_ids) is a FAIL
    # naming the exception, as in generate, not a posdiag error: a thinker config without vision_start_token_id.
    model = small_model("qwen2_5_omni_thinker")
    del model.config.vision_start_token_id
    result = run_checks(from_module(model, name="no vision_start_token_id"), ["batch"],
                        RunOptions(seq_len=12)).check("batch")
    assert result.status is Status.FAIL, result.summary
    assert "crashed: AttributeError" in result.summary and "vision_start_token_id" in result.summary, result.summary


def test_each_check_starts_from_the_model_as_loaded():
    """generate() leaves the thinker's rope_deltas of a batch of 3 on the model; a later batch-1 cached decode reused
    them and crashed ("expected size 1 but got size 0"). run_checks clears that state between checks."""
    subject = from_module(small_model("qwen3_omni_moe_thinker"), name="qwen3_omni_moe_thinker")
    report = run_checks(subject, ["generate", "cache"], RunOptions(seq_len=12))
    assert report.check("cache").status is Status.PASS, report.check("cache").summary
    assert all(getattr(m, "rope_deltas", None) is None for m in subject.model.modules())
