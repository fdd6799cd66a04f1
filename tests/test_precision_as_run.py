"""The dtype a user asks for is the dtype judged: a bug that exists only in bfloat16 FAILs, named as such.

The plant (tests/plants_precision.py) computes rotary angles from position ids cast to the hidden states' dtype:
exact in float32 and float64, rounded above position 256 in bfloat16. Before, `--dtype bfloat16` upcast the model
to float32 where the plant does nothing, and `shift`'s float64 arbitration removed it again: OK, exit 0.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from posdiag.api import run_checks
from posdiag.cli import app
from posdiag.model.loading import load_subject
from posdiag.options import LoadOptions
from posdiag.results import Status
from posdiag.verdict import FloorVerdict, judge_position_signal, judge_signal_decided, lost_in_run_dtype

PLANTS = "tests.plants_precision"


def _shift(factory: str, **load):
    subject = load_subject(f"{PLANTS}:{factory}", LoadOptions(**load))
    return run_checks(subject, ["shift"]).check("shift"), subject


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_positions_rounded_in_bfloat16_fail_shift_as_run_and_the_twin_passes(family):
    planted, subject = _shift(f"{family}_positions_in_run_dtype", dtype="bfloat16")
    assert subject.dtype_name == "bfloat16"  # judged as asked, not upcast
    assert planted.status is Status.FAIL, planted.summary
    assert planted.summary.startswith("only in bfloat16 as run: at shift 256 ")
    assert planted.metrics["as_run_ratio"] > 10
    healthy, _ = _shift(family, dtype="bfloat16")
    assert healthy.status is Status.PASS, healthy.summary
    assert "as run in bfloat16 the drift from float64 stays within" in healthy.summary
    assert healthy.metrics["as_run_ratio"] < 3  # measured 1.1 (llama), far inside the band of 10


def test_the_same_plant_in_float32_is_no_bug():
    """The cast is a no-op in float32: nothing to find there, and shift says so (PASS, no as-run clause)."""
    result, subject = _shift("llama_positions_in_run_dtype", dtype="float32")
    assert subject.dtype_name == "float32"
    assert result.status is Status.PASS, result.summary
    assert "as_run" not in result.details


def test_cli_bfloat16_reads_the_plant_and_upcast_is_an_explicit_choice(tmp_path):
    runner = CliRunner()
    out = tmp_path / "r.json"
    planted = runner.invoke(app, ["check", f"{PLANTS}:llama_positions_in_run_dtype", "--dtype", "bfloat16",
                                  "--only", "shift,rope", "-q", "--json", str(out)])
    assert planted.exit_code == 1, planted.output
    report = json.loads(out.read_text())
    assert report["model"]["dtype"] == "bfloat16"
    assert {c["name"]: c["status"] for c in report["checks"]} == {"shift": "fail", "rope": "fail"}
    upcast = runner.invoke(app, ["check", f"{PLANTS}:llama_positions_in_run_dtype", "--dtype", "bfloat16",
                                 "--upcast", "--only", "shift", "-q"])
    assert upcast.exit_code == 0, upcast.output  # the function in float32 has no bug: the user asked for that


def _lp(residual: float, floor: float = 7.8e-3) -> FloorVerdict:
    return judge_position_signal(residual, floor, "bfloat16")


def test_lost_in_run_dtype_rule_both_ways():
    # float64 shows 0.9 (115x bfloat16's floor): bfloat16 could hold it, and shows only 2x its floor -> lost.
    assert lost_in_run_dtype(_lp(0.0156), 0.9)
    decided = judge_signal_decided(_lp(0.0156), 0.9, 1e-16, "bfloat16", "float64", "jitter")
    assert decided.status is Status.FAIL and "lost in bfloat16 only" in decided.reason
    # A weak signal (float64 0.2 = 26x bfloat16's floor) inconclusive in bfloat16: rounding hides it, no bug.
    assert not lost_in_run_dtype(_lp(0.0156), 0.2)
    decided = judge_signal_decided(_lp(0.0156), 0.2, 1e-16, "bfloat16", "float64", "jitter")
    assert decided.status is Status.PASS and "inconclusive in bfloat16" in decided.reason
    # bfloat16 already shows 30x its floor: rounding shrank nothing that matters, no FAIL.
    assert not lost_in_run_dtype(_lp(0.234), 0.9)
    # No position signal in float64 either: outputs merely permute, a FAIL of the function, not of the dtype.
    decided = judge_signal_decided(_lp(0.0078), 1e-16, 1e-16, "bfloat16", "float64", "jitter")
    assert decided.status is Status.FAIL and "lost in bfloat16" not in decided.reason
