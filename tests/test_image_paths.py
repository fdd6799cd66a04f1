"""Two more paths an image prompt takes (posdiag.checks._image_paths): a chunked prefill (`cache`: generate() with
prefill_chunk_size, chunks ending inside both images) and the prompt as a row of a left-padded batch (`batch`),
each against the layout's numbering, exactly. Healthy Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V PASS; plants
(tests/plants_multimodal.py) FAIL naming the token, its span and where it ran. GLM-4V is the third family: its own
get_rope_index, its video frames written as image tokens between delimiters with a timestamp after each."""

from __future__ import annotations

import warnings

import plants_multimodal as plants
import pytest
import torch
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v")


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def _checks(model, names):
    return {c.name: c for c in run_checks(from_module(model, name="m"), names, RunOptions(seq_len=12)).checks}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_healthy_families_pass_the_chunked_prefill_and_the_padded_row(model_type):
    checks = _checks(plants.healthy(model_type), ["cache", "batch"])
    cache, batch = checks["cache"], checks["batch"]
    assert cache.status is Status.PASS, cache.summary
    assert "; images: chunked prefill (5 tokens a forward): positions continue from rope_deltas -5 (8 tokens, " \
        in cache.summary
    assert cache.details["chunked_prefill"]["mismatch"] == ""
    assert cache.details["chunked_prefill"]["floor_source"].startswith("token embeddings of one row jittered")
    assert batch.status is Status.PASS, batch.summary
    assert "; image prompt in a left-padded batch: the image row is numbered and computed as alone (2 images, " \
        in batch.summary


@pytest.mark.parametrize("model_type, token", [
    ("qwen2_vl", "token 5 of image 1 (tokens 4-7) ran at (t, h, w) = (5, 5, 5); the layout puts it at (4, 4, 5)"),
    ("glm4v", "token 5 of image 1 (tokens 3-6) ran at (t, h, w) = (5, 5, 5); the layout puts it at (3, 4, 3)")])
def test_chunks_numbered_as_text_fail_naming_the_image(model_type, token):
    c = _checks(plants.chunks_numbered_as_text(model_type), ["cache"])["cache"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary == f"images: chunked prefill (5 tokens a forward): {token}"


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl", "glm4v"])
def test_padding_counted_in_the_numbering_fails_the_padded_row(model_type):
    c = _checks(plants.padding_counted(model_type), ["batch"])["batch"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith("image prompt in a left-padded batch: token 0 of text (tokens 0-") and \
        ") ran at (t, h, w) = (4, 4, 4) behind 4 padding tokens; alone at (0, 0, 0); text: every row equals itself " \
        "run alone" in c.summary, c.summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_padded_image_row_logits_are_arbitrated_and_can_fail(model_type, dtype):
    """The padded image row's logits judged against the jitter floor of the prompt alone and decided in float64: a
    healthy row PASSes (never a WARN on rounding), a row that attends its padding (positions right) FAILs."""
    good = _checks(plants.healthy(model_type).to(dtype), ["batch"])["batch"]
    assert good.status is Status.PASS, good.summary
    assert "image prompt in a left-padded batch: the image row is numbered and computed as alone" in good.summary
    assert good.details["padded_image"]["floor_source"].startswith("token embeddings of one row jittered")
    bad = _checks(plants.padding_attended_with_images(model_type).to(dtype), ["batch"])["batch"]
    assert bad.status is Status.FAIL, bad.summary
    assert bad.summary.startswith("image prompt in a left-padded batch: numbered as alone, but the row's logits "
                                  "differ from the prompt's alone by "), bad.summary
    assert "in float64: a bug (it does not shrink with precision)" in bad.summary, bad.summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_chunks_rotated_at_the_prompts_leading_positions_fail_on_their_logits(model_type, dtype):
    """A chunked prefill whose later chunks are rotated at the prompt's leading positions (mlx-vlm #1741's class)
    below what the rotary module is handed: positions read as the layout, the logits FAIL, decided in float64; the
    decode after an unchunked prefill still PASSes. (Healthy twins: tests/test_image_decode.py.)"""
    c = _checks(plants.chunks_at_leading_positions_beneath(model_type).to(dtype), ["cache"])["cache"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith("images: chunked prefill (5 tokens a forward): positions continue from rope_deltas "
                                "-5, but the logits differ from the full forward by "), c.summary
    assert "in float64: a bug (it does not shrink with precision)); text: " in c.summary, c.summary
    assert "; after images: decode: positions continue from rope_deltas -5 (8 tokens, " in c.summary, c.summary
    assert c.details["chunked_prefill"]["mismatch"] == ""


def test_glm4v_runs_its_video_as_its_processor_writes_it():
    """GLM-4V's video: a block of image tokens per temporal patch between frame delimiters, its timestamp after, the
    whole between video delimiters. The images and the video each run and are numbered as the layout; together they
    crash transformers' forward (its image placeholder count takes the video's image tokens too): the findings row."""
    good = _checks(plants.healthy("glm4v"), ["positions"])["positions"]
    if pinned(good, "glm4v", "positions"):
        assert "; 2 images alone, a 4-frame video alone numbered as the layout in the forward; each axis moves the " \
            "outputs (t " in good.summary, good.summary
    bad = _checks(plants.forward_second_image_as_first("glm4v"), ["positions"])["positions"]
    assert bad.status is Status.FAIL, bad.summary
    assert "image 2 (tokens 10-15): axis t, h, w off the layout; token 10 numbered (t, h, w) = (3, 3, 3), the layout " \
           "puts it at (8, 8, 8)" in bad.summary, bad.summary


def test_a_numbering_with_audio_is_named_not_an_error():
    """Qwen2.5-Omni's thinker numbers audio too (its get_rope_index takes no mm_token_type_ids): not probed, named."""
    c = _checks(small_model("qwen2_5_omni_thinker"), ["positions"])["positions"]
    assert c.status is Status.PASS, c.summary
    assert "not probed: images and video (Qwen2_5OmniThinkerModel.get_rope_index takes no mm_token_type_ids" \
        in c.summary
