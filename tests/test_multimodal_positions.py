"""Multimodal positions judged with images and a video: two still images and a 4-frame video between text, built in
code (posdiag.model.multimodal_inputs) and numbered by the layout posdiag computes itself (posdiag.model.mrope_layout).
`positions` observes the positions the forward hands the rotary module and FAILs a span numbered off the layout, naming
it and the axes (a bug in the forward's own numbering too, where get_rope_index called aside is right), an axis whose
shift moves nothing, naming its pairs, and a video path that crashes; `cache` and `generate` run their image probe on
two images and FAIL a prompt token or a decoded one off the layout. Healthy tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL PASS
(float32 and bfloat16). Plants: tests/plants_multimodal.py."""

from __future__ import annotations

import io
import warnings

import plants_multimodal as plants
import pytest
import torch
from rich.console import Console
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.model.mrope_layout import departures, layout_positions
from posdiag.model.multimodal_inputs import build_prompt
from posdiag.options import RunOptions
from posdiag.report import console as console_report
from posdiag.results import Status
from posdiag.testing.multimodal import tiny_multimodal

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def _report(model, names):
    return run_checks(from_module(model, name="m"), names, RunOptions(seq_len=12))


def _checks(model, names):
    return {c.name: c for c in _report(model, names).checks}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_healthy_families_pass_with_images_and_video(model_type):
    report = _report(plants.healthy(model_type), ["positions"])
    c = report.checks[0]
    assert c.status is Status.PASS, c.summary
    assert "images: 2 images and a 4-frame video numbered as the layout in the forward; each axis moves the outputs " \
        "(t " in c.summary
    assert c.details["multimodal"]["departures"] == []
    assert set(c.details["multimodal"]["axes"]) == {"t", "h", "w"}
    assert report.model.tested == "language model with 2 images and a 4-frame video"
    out = io.StringIO()
    console_report.render(report, Console(file=out, width=200, color_system=None))
    assert "tested: language model with 2 images and a 4-frame video" in out.getvalue()
    assert "multimodal RoPE axes" in out.getvalue()


@pytest.mark.parametrize("model_type, step", [("qwen2_vl", 1), ("qwen2_5_vl", 3)])
def test_the_layout_numbers_two_images_and_a_video(model_type, step):
    """Qwen2.5-VL's video: 2 frames a temporal patch, 0.875 s apart, at 2 positions a second: 3.5 positions a patch
    (not an integer: a numbering by index gives 1, truncated seconds 2)."""
    prompt, why = build_prompt(plants.healthy(model_type), 0)
    assert why == ""
    names = [s.name() for s in prompt.spans if s.kind != "text"]
    assert names == ["image 1 (tokens 4-7)", "image 2 (tokens 13-18)", "video 1 (tokens 24-39)"]
    pos = layout_positions(prompt.spans)
    assert pos[:, 13].tolist() == [11, 11, 11] and pos[:, 18].tolist() == [11, 12, 13]  # image 2: 2 x 3 from 11
    assert pos[:, 32].tolist() == [19 + step, 19, 19]  # the video's second temporal patch
    assert departures(prompt.numbering(), prompt.spans) == []


@pytest.mark.parametrize("model_type", FAMILIES)
def test_second_image_numbered_as_the_first_fails_naming_it(model_type):
    checks = _checks(plants.second_image_as_first(model_type), ["positions", "cache", "generate"])
    c = checks["positions"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith("images: image 2 (tokens 13-18): axis t, h, w off the layout; token 13 numbered "
                                "(t, h, w) = (4, 4, 4), the layout puts it at (11, 11, 11) (as the forward applies "
                                "it); the outputs from there move "), c.summary
    assert c.details["multimodal"]["moved_by_numbering"] > 1e-4
    for name, path in (("cache", "decode"), ("generate", "generate")):
        assert checks[name].status is Status.FAIL, checks[name].summary
        assert (f"after images: {path}: token 13 of image 2 (tokens 13-18) ran at (t, h, w) = (4, 4, 4); the layout "
                "puts it at (11, 11, 11)") in checks[name].summary


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_rotary_reading_one_stream_fails_naming_the_axes(model_type):
    c = _checks(plants.one_dimensional_rotary(model_type), ["positions"])["positions"]
    assert c.status is Status.FAIL, c.summary
    assert "shifting axis h on the vision tokens moves nothing (pairs " in c.summary
    assert "shifting axis w on the vision tokens moves nothing" in c.summary
    assert "axis t on" not in c.summary
    axes = c.details["multimodal"]["axes"]
    assert [axes[a]["status"] for a in "thw"] == ["pass", "fail", "fail"]
    layout = "chunked" if model_type == "qwen2_vl" else "interleaved"
    assert axes["h"]["pairs"] == ("pairs 4-5 of 8 (chunked)" if layout == "chunked" else "pairs 1,4 of 8 (interleaved)")


def test_chunked_slow_axes_are_decided_in_float64():
    """Qwen2-VL's w pairs are the two slowest of 8: a shift of 5 moves the float32 outputs by ~3 floors. Decided
    in float64 (a signal, far above that floor), never a FAIL on the run dtype's rounding."""
    c = _checks(plants.healthy("qwen2_vl"), ["positions"])["positions"]
    axes = c.details["multimodal"]["axes"]
    assert axes["w"]["status"] == "pass" and "float64" in axes["w"]["reason"], axes["w"]
    assert "w " in c.summary and "in float64" in c.summary


@pytest.mark.parametrize("build, got", [(plants.frames_by_index, 20), (plants.seconds_truncated, 21),
                                        (plants.images_take_video_seconds, 21), (plants.forward_drops_seconds, 21)])
def test_video_temporal_index_plants_fail_on_axis_t(build, got):
    """The second temporal patch of Qwen2.5-VL's video sits 3.5 positions on (3 after the floor): numbered by index (1),
    with the seconds truncated (1 s: 2), or with the default second a patch (2) it is off the layout."""
    c = _checks(build(), ["positions"])["positions"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith(f"images: video 1 (tokens 24-39): axis t off the layout; token 32 numbered "
                                f"(t, h, w) = ({got}, 19, 19), the layout puts it at (22, 19, 19)"), c.summary


@pytest.mark.parametrize("build, model_type", [(plants.forward_drops_seconds, "qwen2_5_vl"),
                                               (plants.forward_second_image_as_first, "qwen2_vl"),
                                               (plants.forward_second_image_as_first, "qwen3_vl")])
def test_a_bug_in_the_forwards_own_numbering_fails(build, model_type):
    """compute_3d_position_ids numbers the prompt off the layout while get_rope_index called aside is right: the
    positions the rotary module is handed decide."""
    model = build(model_type)
    prompt, _ = build_prompt(model, 0)
    assert departures(prompt.numbering(), prompt.spans) == []
    c = _checks(model, ["positions"])["positions"]
    assert c.status is Status.FAIL, c.summary
    assert "off the layout" in c.summary and "(as the forward applies it)" in c.summary, c.summary
    assert c.details["multimodal"]["departures"], c.details["multimodal"]


@pytest.mark.parametrize("build, model_type, status", [(plants.healthy, "qwen2_5_vl", Status.PASS),
                                                       (plants.healthy, "qwen3_vl", Status.PASS),
                                                       (plants.frames_by_index, "qwen2_5_vl", Status.FAIL),
                                                       (plants.forward_second_image_as_first, "qwen3_vl", Status.FAIL)])
def test_bfloat16_numbering_as_in_float32(build, model_type, status):
    c = _checks(build(model_type).to(torch.bfloat16), ["positions"])["positions"]
    assert c.status is status, c.summary
    assert ("images: 2 images and a 4-frame video numbered as the layout in the forward" in c.summary) == \
        (status is Status.PASS), c.summary


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl", "glm4v"])
def test_a_video_path_that_crashes_fails_never_passes(model_type):
    """The video features raise: the images alone still run and are judged, the crash is a FAIL naming it."""
    c = _checks(plants.video_tower_crashes(model_type), ["positions"])["positions"]
    assert c.status is Status.FAIL, c.summary
    assert c.summary.startswith("images: a 4-frame video crashed: IndexError: planted: index 2 is out of bounds "), \
        c.summary
    assert "; 2 images alone numbered as the layout in the forward; each axis moves the outputs" in c.summary


def test_qwen2_5_vl_text_after_a_video_is_the_findings_row():
    """transformers 5.25 resumes the text after a video at start + max(h, w), inside the video's temporal range when
    its temporal positions reach further (the findings table: qwen2_5_vl positions)."""
    c = _checks(plants.video_overlap(), ["positions"])["positions"]
    pinned(c, "qwen2_5_vl", "positions")


def test_a_model_whose_tower_refuses_the_prompt_is_not_probed_and_text_still_judged():
    c = _checks(plants.tower_that_cannot_run(), ["positions"])["positions"]
    assert c.status is Status.PASS, c.summary
    assert "not probed: images and video (the model's plain forward of posdiag's prompt (2 images and a 4-frame " \
           "video) raised RuntimeError: planted: the vision tower cannot run on this device" in c.summary
    assert c.summary.startswith("consistent permutation reproduces P f(x)")


def test_image_tokens_outside_the_vocabulary_are_named():
    report = _report(tiny_multimodal("qwen2_vl"), ["positions"])
    c = report.checks[0]
    assert c.status is Status.PASS, c.summary
    assert "not probed: images and video (the image token 151655 is outside the 256-row embedding)" in c.summary
    assert "vision tower not tested" in report.model.tested


def test_models_without_mrope_are_unchanged():
    c = _checks(tiny_multimodal("llava"), ["positions"])["positions"]
    assert "images" not in c.summary and "multimodal" not in c.details
