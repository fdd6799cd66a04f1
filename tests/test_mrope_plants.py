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
