"""The committed checkpoints under fixtures/: fixtures/make_fixtures.py writes the same bytes again, and the
vision-language one is checked with images and a video, as a user trying multimodal meets it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sweep_support import holds, pinned
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.results import CheckResult, Status

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VLM = FIXTURES / "qwen2-vl-tiny"
FED = "language model with 2 images and a 4-frame video"


def _make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(path: Path) -> dict:
    """config.json without the version of transformers that wrote it (the fixtures predate the pinned one)."""
    config = json.loads(path.read_text())
    config.pop("transformers_version", None)
    return config


def test_make_fixtures_writes_every_committed_checkpoint_again(tmp_path):
    """Same seed, same bytes: each committed weights file and config (but for the writer's version), none missing."""
    from transformers.utils import logging

    make = _make_fixtures()
    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    try:
        make.main(tmp_path)  # quiets transformers' logging: put back for the tests after
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert str(Path(make.VLM) / "model.safetensors") in map(str, written)
    for rel in written:
        committed = FIXTURES / rel
        assert committed.is_file(), f"fixtures/{rel} is written by make_fixtures.py but not committed"
        if rel.name == "config.json":
            assert _config(tmp_path / rel) == _config(committed), f"fixtures/{rel} differs from what the script writes"
        else:
            assert (tmp_path / rel).read_bytes() == committed.read_bytes(), f"fixtures/{rel} differs"
    assert sum(p.stat().st_size for p in VLM.iterdir()) < 1_000_000  # a fixture stays small


def test_the_vlm_fixture_is_checked_with_images_and_video(tmp_path):
    """`posdiag check fixtures/qwen2-vl-tiny`: the header says two images and a video were fed, the checks that run
    the image prompt say so, and every verdict is a PASS, an N/A, a SKIP with its reason, or the FAIL of an upstream
    finding the table says holds on this transformers (the kept rope_deltas: `state`); -q keeps the tested line."""
    report = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["check", str(VLM), "--json", str(report), "-q"])
    data = json.loads(report.read_text())
    assert data["model"]["tested"] == FED
    assert result.stdout.splitlines()[0] == f"tested: {FED}"
    checks = {c["name"]: CheckResult(c["name"], Status(c["status"]), c["summary"]) for c in data["checks"]}
    assert "images: 2 images and a 4-frame video numbered as the layout" in checks["positions"].summary
    for name in ("cache", "generate"):
        assert "after images" in checks[name].summary, checks[name].summary
    found = [name for name, r in checks.items() if holds("qwen2_vl", name) and pinned(r, "qwen2_vl", name)]
    for name, r in checks.items():
        if name in found:
            continue
        assert r.status in (Status.PASS, Status.NA, Status.SKIP), f"{name}: {r.status.value} {r.summary}"
        assert r.summary.strip(), name  # a skip or n/a names its reason
    assert result.exit_code == (1 if found else 0), result.output
