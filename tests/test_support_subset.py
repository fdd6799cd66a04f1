"""A representative subset of the support sweep (benchmarks/sweep.py), in-process: the sweep's own row builder for
varied model types (a RoPE causal LM, a learned-position causal LM, an encoder, a masked LM, a vision-language
model with mRoPE, a decoder with no quirk row). Every check gives a verdict or a SKIP with its reason: no `error`,
no FAIL on a healthy default-init model (documented upstream findings would be listed here), every SKIP
explained. The whole sweep is `python benchmarks/support_matrix.py --all --write`."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
from sweep_rows import rotating

SWEEP = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"
SUBSET = ("llama", "opt", "bert", "roberta", "qwen2_vl", "afmoe", "mamba")


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_type", rotating(SUBSET, always=("llama", "qwen2_vl")))
def test_sweep_row(model_type):
    warnings.filterwarnings("ignore")
    sweep = _sweep()
    row = sweep.check_one(model_type, seq_len=12, threads=2)
    assert "checks" in row, row.get("unbuildable")
    for name, (status, summary) in row["checks"].items():
        assert status != "error", (name, summary)
        if status == "fail":
            assert name in sweep.FINDINGS.get(model_type, {}), (name, summary)  # documented upstream findings
        if status == "skip":
            assert summary.strip(), name
    assert any(status == "pass" for status, _ in row["checks"].values())


def test_readme_quotes_the_committed_sweep():
    """The README's coverage line is the one write_page() generates from benchmarks/sweep.jsonl: no stale counts."""
    sweep = _sweep()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("<!-- sweep-counts:start -->\n", 1)[1].split("\n<!-- sweep-counts:end -->", 1)[0]
    assert block == sweep.readme_sentence(sweep.counts())
