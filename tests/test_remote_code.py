"""A checkpoint that ships its own modeling code (auto_map), loaded without --trust-remote-code: transformers
builds its built-in class for the model_type, and the report says that class, not the shipped code, was tested.
The shipped code must never run."""

import json

import pytest
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.testing import zoo

runner = CliRunner()


@pytest.fixture
def shipping_code(tmp_path):
    """A tiny Llama checkpoint whose config names its own modeling file; importing that file leaves a marker."""
    ckpt = tmp_path / "ckpt"
    zoo.tiny_model("llama").save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.MyLlama"}
    (ckpt / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "modeling_x_ran"
    (ckpt / "modeling_x.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('shipped code ran')\n")
    return ckpt, marker


def test_untested_shipped_code_is_named(shipping_code):
    ckpt, marker = shipping_code
    result = runner.invoke(app, ["check", str(ckpt), "--only", "load,shuffle", "--json", "-"],
                           env={"COLUMNS": "250"})
    assert not marker.exists(), "the checkpoint's own code ran without --trust-remote-code"
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    model = data["model"]
    assert model["class"] == "LlamaForCausalLM"
    assert model["shipped_code"]["auto_map"] == {"AutoModelForCausalLM": "modeling_x.MyLlama"}
    assert model["shipped_code"]["tested"] is False
    load = data["checks"][0]
    assert load["status"] == "warn"
    assert load["summary"].startswith(
        "the checkpoint ships its own modeling code (auto_map: AutoModelForCausalLM: modeling_x.MyLlama); "
        "without --trust-remote-code posdiag tested transformers' built-in LlamaForCausalLM, not that code")
    assert "not tested: the checkpoint ships its own modeling code" in result.stderr  # the header
    assert "no position bug found" not in result.stderr  # a WARN: not a full bill of health


def test_checkpoint_without_shipped_code_is_unchanged(fixtures_dir):
    result = runner.invoke(app, ["check", str(fixtures_dir / "llama-tiny"), "--only", "load", "--json", "-"])
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert result.exit_code == 0 and data["checks"][0]["status"] == "n/a"  # RoPE: nothing stored
    assert data["model"]["shipped_code"] is None and data["model"]["class"] == "LlamaForCausalLM"


def test_the_marker_does_catch_shipped_code_running(shipping_code, tmp_path):
    """The twin that proves the marker works: with --trust-remote-code the shipped file is imported (it raises,
    so loading fails with exit 2). Run in a subprocess so transformers' module cache goes under tmp_path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ckpt, marker = shipping_code
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "posdiag", "check", str(ckpt), "--only", "load",
                           "--trust-remote-code"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "shipped code ran" in proc.stderr
    assert marker.exists()
