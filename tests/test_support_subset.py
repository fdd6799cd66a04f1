"""A representative subset of the support sweep (benchmarks/sweep.py), in-process: the sweep's own row builder for
varied model types (a RoPE causal LM, a learned-position causal LM, an encoder, a masked LM, a vision-language
model with mRoPE, a decoder with no quirk row). Every check gives a verdict or a SKIP with its reason: no `error`,
no FAIL on a healthy default-init model (documented upstream findings would be listed here), every SKIP
explained. The whole sweep is `python benchmarks/support_matrix.py --all --write`. The committed rows and the
findings list agree: every FINDINGS entry is what its row shows (its fingerprint matches), every FAIL is one of
them, and each names the test that reproduces it in plain transformers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from sweep_rows import exhaustive
from sweep_support import sweep_module

ROOT = Path(__file__).resolve().parent.parent
SUBSET = ("llama", "opt", "bert", "roberta", "qwen2_vl", "afmoe", "mamba")


def _sweep():
    return sweep_module()


@pytest.mark.parametrize("model_type", exhaustive(SUBSET, always=("llama", "qwen2_vl")))
def test_sweep_row(model_type):
    warnings.filterwarnings("ignore")
    sweep = _sweep()
    row = sweep.check_one(model_type, seq_len=12, threads=None)
    assert "checks" in row, row.get("unbuildable")
    for name, (status, summary) in row["checks"].items():
        assert status != "error", (name, summary)
        if status == "fail":
            assert sweep.finding_of(row, name), (name, summary)  # a documented upstream finding, as it fails
        if status == "skip":
            assert summary.strip(), name
    assert any(status == "pass" for status, _ in row["checks"].values())


def test_readme_quotes_the_committed_sweep():
    """The README's coverage line is the one write_page() generates from benchmarks/sweep.jsonl: no stale counts."""
    sweep = _sweep()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("<!-- sweep-counts:start -->\n", 1)[1].split("\n<!-- sweep-counts:end -->", 1)[0]
    assert block == sweep.readme_sentence(sweep.counts())


def test_every_finding_is_what_its_committed_row_shows():
    sweep = _sweep()
    assert sweep.stale_findings() == []
    rows = sweep.done()
    unclassified = [(t, n, s[1]) for t, r in rows.items() for n, s in r.get("checks", {}).items()
                    if s[0] == "fail" and sweep.finding_of(r, n) is None]
    assert unclassified == [], unclassified


def test_a_fail_that_does_not_match_its_fingerprint_is_unclassified():
    sweep = _sweep()
    crash = sweep.FINDINGS["gpt_neo"]["cache"]
    assert crash.matches("static/decode crashed: RuntimeError: The size of tensor a (256) must match the size of "
                         "tensor b (263) at non-singleton dimension 3")
    assert not crash.matches("static/decode: step 1 (position 8) differs from the full forward by 0.3")  # wrong values
    assert not crash.matches("static/decode crashed: IndexError: index out of range")  # another exception
    assert not crash.matches("dynamic/decode crashed: RuntimeError: must match the size of tensor b")  # another path
    wrong = sweep.FINDINGS["mamba"]["cache"]
    assert wrong.matches("dynamic/chunks: step 1 (positions 4-6) differs from the full forward by 0.00362")
    assert not wrong.matches("dynamic/chunks crashed: RuntimeError: boom")
    assert not wrong.matches("dynamic/decode: step 1 (position 8) differs from the full forward by 0.01")
    row = {"type": "mamba", "checks": {"cache": ["fail", "dynamic/decode: step 1 differs by 0.01"]}}
    assert sweep.finding_of(row, "cache") is None


def test_every_finding_names_a_test_that_exists():
    sweep = _sweep()
    for model_type, name, finding in sweep.every_finding():
        path, _, function = finding.test.partition("::")
        assert f"def {function}(" in (ROOT / path).read_text(), (model_type, name, finding.test)


def test_a_serving_crash_is_told_from_wrong_values():
    """`serving` names the path and what it ran, then how it crashed: a crash fingerprint matches that, and a
    wrong-values fingerprint of the same path does not."""
    sweep = _sweep()
    crash = sweep.FINDINGS["qwen2_5_omni_thinker"]["serving"]
    crashed = ("decode loop after another prompt: a hand-written decode loop (4 steps, no position_ids) on the "
               "16-token prompt after the same loop on another prompt: crashed (RuntimeError: The size of tensor a "
               "(17) must match the size of tensor b (9) at non-singleton dimension 3), a path transformers accepts")
    assert crash.matches(crashed)
    assert not crash.matches(crashed.replace("RuntimeError", "IndexError"))
    assert not crash.matches("decode loop after another prompt: a hand-written decode loop: first departs at decode "
                             "step 1 (position 16) by 0.759 = 1.5e+06x the noise floor 5e-07")
    wrong = sweep.FINDINGS["mamba"]["serving"]
    assert wrong.matches("chunks of 3: the 16-token prompt fed 3 tokens a forward into one cache: first departs at "
                         "position 3 by 0.00297 = 5.98e+03x the noise floor 5e-07")
    assert not wrong.matches("chunks of 3: the 16-token prompt fed 3 tokens a forward into one cache: crashed "
                             "(RuntimeError: boom), a path transformers accepts")
