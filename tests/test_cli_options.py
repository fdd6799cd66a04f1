"""The options every model command shares, as users meet them: each checked before anything loads (paths, devices,
server addresses: one line, exit 2), dtype aliases, and --junit/--format/--config on compare, kernels and rope."""

import socket
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posdiag.cli import app

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "fixtures" / "llama-tiny")
runner = CliRunner()


def invoke(*args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


@pytest.fixture
def no_load(monkeypatch):
    """Any model load (MODEL, a reference, a PyTorch candidate) fails the test: the error must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    for target in ("posdiag.model.loading.load_subject", "posdiag.cli._flow.load_model", "posdiag.cli.check.load_model",
                   "posdiag.cli.kernels.load_model", "posdiag.cli.rope.load_model"):
        monkeypatch.setattr(target, refuse)


@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posdiag: error: "), result.output
    return lines[0]


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ checked before anything loads
@pytest.mark.parametrize("args, message", [
    (["compare", TINY, "model.gguf"], "'model.gguf' does not exist"),
    (["compare", "missing.gguf"], "'missing.gguf' does not exist"),
    (["compare", TINY, "graph.onnx"], "'graph.onnx' does not exist"),
    (["compare", TINY, "http://127.0.0.1:notaport/v1"], "is not a server address (its port)"),
    (["compare", TINY, "http://user:pw@127.0.0.1:8080/v1"], "give the base URL only"),
    (["compare", TINY, "http:///v1"], "is not a server address"),
    (["check", "model.gguf"], "'model.gguf' does not exist"),
    (["rope", "model.gguf"], "'model.gguf' does not exist"),
    (["kernels", "model.gguf"], "'model.gguf' does not exist"),
    (["check", TINY, "--max-memory", "0=70GiB"], "--max-memory only applies with --device-map"),
    (["compare", TINY, TINY, "--offload-folder", "x"], "--offload-folder only applies with --device-map"),
    (["compare", TINY, TINY, "--junit", "no/such/folder/j.xml"], "does not exist"),
    (["compare", TINY, TINY, "--format", "xml"], "--format xml"),
    (["kernels", TINY, "--junit", "."], "is a directory"),
    (["rope", TINY, "--json", "-", "--junit", "-"], "only one output can go to stdout"),
])
def test_paths_and_addresses_are_one_line_before_any_load(args, message, no_load, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in one_error_line(invoke(*args))


@pytest.mark.parametrize("command", [["check", TINY], ["shuffle", TINY], ["compare", TINY, TINY], ["kernels", TINY],
                                     ["rope", TINY]])
def test_a_device_this_machine_lacks_is_one_line_before_any_load(command, no_load, no_cuda):
    line = one_error_line(invoke(*command, "--device", "cuda"))
    assert "--device cuda: CUDA is not available on this machine" in line


def test_an_unreachable_server_is_the_users_input_exit_2_before_the_reference_loads(no_load):
    """Nothing answers at the address: one line, exit 2 (a missing file's code), asked before the reference loads
    (the loader refuses); exit 3 stays for a server that answered and then failed."""
    line = one_error_line(invoke("compare", TINY, f"http://127.0.0.1:{closed_port()}/v1"))
    assert "could not be reached" in line and "is it running" in line, line


# ------------------------------------------------------------------ dtype aliases
@pytest.mark.parametrize("alias, dtype", [("bf16", "bfloat16"), ("FP16", "float16"), ("half", "float16"),
                                          ("fp32", "float32"), ("float", "float32"), ("fp64", "float64"),
                                          ("float32", "float32")])
def test_dtype_aliases_are_accepted(alias, dtype):
    for command in (["check", TINY], ["compare", TINY, TINY], ["kernels", TINY], ["rope", TINY]):
        result = invoke(*command, "--dtype", alias, "--show-config", env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        row = next(line for line in result.output.splitlines() if "│ dtype" in line)
        assert f"'{dtype}'" in row and "command line" in row, row


def test_a_dtype_that_is_none_names_the_choices_in_one_line(tmp_path, monkeypatch):
    result = invoke("check", TINY, "--dtype", "bf17")
    assert result.exit_code == 2
    error = [line for line in result.output.splitlines() if "bf17" in line]
    assert len(error) == 1 and "auto, float32, float64, bfloat16, float16 (or bf16, fp16" in error[0], result.output
    assert "Value error" not in result.output
    monkeypatch.chdir(tmp_path)
    (tmp_path / "posdiag.toml").write_text('dtype = "bf16"\n')
    shown = invoke("compare", TINY, TINY, "--show-config", env={"COLUMNS": "200"}).output
    assert "'bfloat16'" in next(line for line in shown.splitlines() if "│ dtype" in line)
    (tmp_path / "posdiag.toml").write_text('dtype = "b16"\n')
    assert "dtype 'b16' from the config file is no dtype" in one_error_line(invoke("compare", TINY, TINY))


# ------------------------------------------------------------------ the common options on every model command
def test_compare_kernels_and_rope_take_junit_format_and_config():
    for command in ("check", "compare", "kernels", "rope"):
        text = invoke(command, "--help", env={"COLUMNS": "200"}).output
        for option in ("--junit", "--format", "--config", "--show-config", "--json", "--quiet", "--debug", "--dtype"):
            assert option in text, (command, option)
    text = invoke("compare", "--help", env={"COLUMNS": "200"}).output
    text_help = text[text.index("--text"):].split("\n  --", 1)[0]
    assert "fit" not in text_help and "reference's tokenizer" in text_help, text_help


def test_compare_writes_junit_and_reads_its_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "posdiag.toml").write_text("seq_len = 16\n")
    result = invoke("compare", TINY, TINY, "--junit", "j.xml", "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("PASS compare:") and "(16 tokens)" in result.stdout, result.output
    case = ET.parse(tmp_path / "j.xml").getroot().find("testcase")
    assert case.get("name") == "compare" and case.find("failure") is None


def test_a_compare_log_says_each_stage_with_the_time(tmp_path):
    """Outside a terminal (a CI log) the spinner shows nothing: each stage is one line with the time so far."""
    result = invoke("compare", TINY, TINY, "--seq-len", "8")
    assert result.exit_code == 0, result.output
    stages = [line for line in result.stderr.splitlines() if line.startswith("posdiag: compare: ")]
    assert stages and stages[0].startswith("posdiag: compare: both models layer by layer on 8 tokens"), result.stderr
    assert all(line.endswith(" s)") for line in stages), stages


def test_rope_and_kernels_write_junit(tmp_path):
    rope = invoke("rope", TINY, "--junit", tmp_path / "rope.xml", "-q")
    assert rope.exit_code == 0, rope.output
    assert [c.get("name") for c in ET.parse(tmp_path / "rope.xml").getroot().iter("testcase")] == ["rope"]
    static = invoke("rope", TINY, "--config-only", "--junit", tmp_path / "static.xml")
    assert "the config alone gives no verdict" in one_error_line(static)
    kernels = invoke("kernels", TINY, "--seq-len", "8", "--junit", tmp_path / "kernels.xml", "-q")
    assert kernels.exit_code == 0, kernels.output
    assert [c.get("name") for c in ET.parse(tmp_path / "kernels.xml").getroot().iter("testcase")] == ["kernels"]
    synthetic = invoke("kernels", "--synthetic", "--junit", tmp_path / "s.xml")
    assert "--junit: for a run on a model" in one_error_line(synthetic)
