"""Decode positions after images (multimodal RoPE): a prompt with two image placeholder grids makes rope_deltas
non-zero, and every decoded or generated token must sit where the model's own get_rope_index numbers it in the
whole sequence. Plants that drop rope_deltas or restart at 0 FAIL `cache` (manual decode loop) or `generate`;
their healthy twins PASS. Tiny towers with random pixel values (posdiag.checks._image_decode)."""

from __future__ import annotations

import warnings

import plants_mrope as plants
import plants_multimodal
import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import tiny_multimodal
from posdiag.verdict import FAIL_RATIO


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def _checks(model, names):
    report = run_checks(from_module(model, name="m"), names, RunOptions(seq_len=12))
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_healthy_decode_after_an_image_passes(model_type):
    checks = _checks(plants.with_image(model_type), ["cache", "generate"])
    for name, path in (("cache", "decode"), ("generate", "generate")):
        c = checks[name]
        assert c.status is Status.PASS, c.summary
        assert f"after images: {path}: positions continue from rope_deltas -5" in c.summary
        assert c.details["after_image"]["mismatch"] == ""
        assert c.details["after_image"]["floor_source"].startswith("token embeddings of one row jittered")
        # its power: the same path one position early would FAIL (float32), and the summary says by how much
        assert c.details["after_image"]["slip"]["ratio"] > FAIL_RATIO, c.details["after_image"]["slip"]
        assert "; a one-position slip on its continued forwards: " in c.summary, c.summary


@pytest.mark.parametrize("build, at", [(plants.decode_ignoring_rope_deltas, "(23, 23, 23)"),
                                       (plants.decode_restarting_at_zero, "(0, 0, 0)")])
def test_manual_decode_off_rope_deltas_fails_cache(build, at):
    c = _checks(build("qwen2_vl"), ["cache"])["cache"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith(f"after images: decode: token 23 (decode step 0) ran at (t, h, w) = {at}; after "
                                "the images the layout puts it at (18, 18, 18) (rope_deltas -5)"), c.summary


@pytest.mark.parametrize("build, at", [(plants.generate_ignoring_rope_deltas, "(23, 23, 23)"),
                                       (plants.generate_restarting_at_zero, "(0, 0, 0)")])
def test_generate_off_rope_deltas_fails_generate(build, at):
    c = _checks(build("qwen2_vl"), ["generate"])["generate"]
    assert c.status is Status.FAIL, c.summary
    assert f"after images: generate: token 23 (decode step 0) ran at (t, h, w) = {at}" in c.summary


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_image_path_logits_of_bfloat16_weights_are_decided_in_float32_and_read_once_as_stored(model_type):
    """Decode, generate() and the chunked prefill after images with bfloat16 weights: the logits against the jitter
    floor of the full forward, decided with the weights held in float32 (where a one-position slip stands far above
    the floor), then every path once more as stored, within rounding. (float32: the healthy tests above and
    tests/test_image_paths.py.)"""
    from decided import assert_decided_in_float32

    checks = _checks(plants.with_image(model_type).to(torch.bfloat16), ["cache", "generate"])
    for name, key, path in (("cache", "after_image", "after images: decode"),
                            ("cache", "chunked_prefill", "images: chunked prefill (5 tokens a forward)"),
                            ("generate", "after_image", "after images: generate")):
        c = checks[name]
        assert c.status is Status.PASS, c.summary
        assert f"{path}: positions continue from rope_deltas -5 (" in c.summary, c.summary
        info = c.details[key]
        assert info["floor_source"].startswith("token embeddings of one row jittered") and info["noise_floor"] > 0
        assert info["slip"]["error"] is not None and info["slip"]["dtype"] == "float32", info["slip"]
        assert info["slip"]["ratio"] > 10, info["slip"]
        assert_decided_in_float32(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_decode_rotated_without_rope_deltas_fails_on_its_logits(model_type, dtype):
    """Decoded tokens rotated at their text positions (rope_deltas dropped where the positions are applied, the ids
    handed to the rotary module right): the positions read as the layout, the logits FAIL, decided in float64."""
    checks = _checks(plants_multimodal.decode_deltas_dropped_beneath(model_type).to(dtype), ["cache", "generate"])
    for name, path in (("cache", "decode"), ("generate", "generate")):
        c = checks[name]
        assert c.status is Status.FAIL, c.summary
        assert c.summary.startswith(f"after images: {path}: positions continue from rope_deltas -5, but the logits "
                                    "differ from the full forward by "), c.summary
        assert "in float64: a bug (it does not shrink with precision)); text: " in c.summary, c.summary
        assert c.details["after_image"]["mismatch"] == ""


def test_dropped_deltas_are_invisible_without_an_image():
    # the same plant on text alone: the three streams equal the text positions, so only the image probe sees it
    # (a FAIL of the text runs would lead the summary, with the image probe's finding appended after it)
    c = _checks(plants.generate_ignoring_rope_deltas("qwen2_vl"), ["generate"])["generate"]
    assert c.status is Status.FAIL
    assert c.summary.startswith("after images: generate:"), c.summary


def test_without_image_tokens_in_the_vocabulary_it_says_so():
    c = _checks(tiny_multimodal("qwen2_vl"), ["cache"])["cache"]
    assert c.status is Status.PASS, c.summary
    assert "not probed: decode after images (the image token 151655 is outside the 256-row embedding)" in c.summary


def test_models_without_mrope_are_unchanged():
    c = _checks(tiny_multimodal("llava"), ["cache"])["cache"]
    assert "after images" not in c.summary and "after_image" not in c.details


def test_a_crash_of_the_decode_after_an_image_fails_naming_it():
    """The plain forward of the image prompt runs, the cached step after it raises: a path users take, a FAIL."""
    c = _checks(plants.decode_crashing_after_an_image("qwen2_vl"), ["cache"])["cache"]
    assert c.status is Status.FAIL, c.summary
    assert "after images: decode raised IndexError: planted: decode step after an image" in c.summary
    assert c.details["after_image"]["crashed"].startswith("IndexError")


def test_an_input_the_plain_forward_refuses_is_not_probed():
    """posdiag's own prompt refused by the plain forward says nothing about the model: not probed, with why."""
    c = _checks(plants.refusing_pixel_values("qwen2_vl"), ["cache"])["cache"]
    assert c.status is Status.PASS, c.summary
    assert "not probed: decode after images (the plain forward of posdiag's image prompt raised ValueError" \
        in c.summary
