"""The rope check on multimodal RoPE with the t/h/w streams apart: sections swapped between q and k, the wrong
layout (chunked vs interleaved) and wrong section sizes are invisible at text positions (three equal streams) and
FAIL on an image grid positioned by the model's own get_rope_index and on distinct streams; healthy twins PASS."""

from __future__ import annotations

import warnings

import plants_mrope as plants
import pytest

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status

STREAM_PROBES = {"image grid", "distinct streams"}


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def _rope(model, name):
    return run_checks(from_module(model, name=name), ["rope"], RunOptions(seq_len=16)).checks[0]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_healthy_mrope_passes_with_streams_apart(model_type):
    check = _rope(plants.healthy(model_type), model_type)
    assert check.status is Status.PASS, check.summary
    assert check.metrics["mrope_streams_probed"] == ["image grid", "distinct streams"]
    assert "distinct t/h/w streams" in check.summary


@pytest.mark.parametrize("name, build", [
    ("qwen2_vl interleaved", lambda: plants.wrong_layout("qwen2_vl")),
    ("qwen3_vl chunked", lambda: plants.wrong_layout("qwen3_vl")),
    ("qwen2_vl sections [2, 4, 2]", lambda: plants.wrong_sections("qwen2_vl")),
    ("qwen3_vl sections [2, 4, 2]", lambda: plants.wrong_sections("qwen3_vl")),
    ("qwen2_vl k with h/w swapped", plants.sections_swapped_between_q_and_k),
])
def test_planted_mrope_fails_only_where_streams_differ(name, build):
    check = _rope(build(), name)
    assert check.status is Status.FAIL, check.summary
    assert check.summary.startswith("mRoPE rotation disagrees with the config's sections"), check.summary
    failing = {f["probe"] for f in check.details["failures"]}
    assert failing == STREAM_PROBES, failing  # each probe sees it alone; the text positions do not
    if "k with" in name:
        assert {f["tensor"] for f in check.details["failures"]} == {"k"}


@pytest.mark.parametrize("model_type, words", [
    ("qwen2_vl", "mRoPE sections (t pairs 0-3 | h 4-5 | w 6-7 of 8, chunked) with distinct t/h/w streams"),
    ("qwen3_vl", "mRoPE sections (t pairs 0,3,6,7 | h 1,4 | w 2,5 of 8, interleaved) with distinct t/h/w streams")])
def test_the_section_boundaries_are_named_per_axis(model_type, words):
    check = _rope(plants.healthy(model_type), model_type)
    assert words in check.summary, check.summary
    table = next(t for t in check.tables if t.title.startswith("mRoPE sections per axis"))
    assert [row[1] for row in table.rows] == ["t", "h", "w"]


def test_a_failing_dim_is_named_by_its_pair_and_axis():
    """The wrong sections [2, 4, 2] on Qwen2-VL: the failing dim's pair and the axis the config gives it."""
    check = _rope(plants.wrong_sections("qwen2_vl"), "wrong sections")
    assert check.status is Status.FAIL
    assert "(chunked [4, 2, 2]: t pairs 0-3 | h 4-5 | w 6-7) at layer " in check.summary, check.summary
    worst = check.details["failures"][0]
    assert f"dim {worst['dim']} (pair {worst['pair']}: axis {worst['axis']})" in check.summary
    assert worst["axis"] == "thw"[[0, 0, 0, 0, 1, 1, 2, 2][worst["pair"]]]  # the config's sections, not the plant's
