"""The command line as users meet it: reports piped into files and at 80 columns keep every number and
verdict whole, the CI gate works from its first run, usage errors come before any loading, a typo in a
local path is one line at once, Ctrl-C is exit 130, help is whole."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from posdiag.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
STATUS_WORDS = ("PASS", "FAIL", "WARN", "SKIP", "ERROR")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def piped(args, tmp_path, **env):
    """`posdiag ARGS > file` at COLUMNS=80: (exit code, the file's text, stderr)."""
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        done = subprocess.run([sys.executable, "-m", "posdiag", *map(str, args)], cwd=ROOT, stdout=sink,
                              stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), **env})
    return done.returncode, out.read_text(), done.stderr


def cut(text: str) -> list[str]:
    """Lines with rich's cut mark (the rope wavelength plot's legend `pair 0 … N` is no cut)."""
    return [line for line in text.splitlines() if "…" in line and "pair 0 …" not in line]


def table_cells(data: dict) -> list[str]:
    return [str(cell) for check in data["checks"] for table in check["details"].get("tables", [])
            for row in table["rows"] for cell in row if str(cell).strip()]


# ------------------------------------------------------------------ every report kind, piped
@pytest.mark.parametrize("args", [
    ["check", "fixtures/llama-tiny", "--only", "shuffle,batch,cache,kernels"],
    ["kernels", "fixtures/llama-tiny"],
    ["rope", "fixtures/llama-tiny"],
    ["compare", "fixtures/llama-tiny", "fixtures/llama-tiny", "--seq-len", "32"],
], ids=lambda a: a[0])
def test_piped_report_keeps_every_number_and_verdict(args, tmp_path):
    report = tmp_path / "r.json"
    code, text, err = piped([*args, "--json", report], tmp_path)
    assert code == 0, text + err
    assert not cut(text), cut(text)
    data = json.loads(report.read_text())
    for cell in table_cells(data):
        assert cell in text, f"{cell!r} is not whole in the piped report"
    for check in data["checks"]:
        assert check["status"].upper() in text
        for table in check["details"].get("tables", []):  # a title wider than its table is not wrapped
            assert any(table["title"] in line for line in text.splitlines()), table["title"]
    padded = [line for line in text.splitlines() if line != line.rstrip()]
    assert not padded, f"{len(padded)} lines end in spaces: {padded[:2]}"
    # stderr holds nothing but a line as the model loads and the one line per finished check a log gets
    loads, *finished = err.splitlines()
    assert loads == f"posdiag: loading {args[1]} ...", err  # stderr's alone: stdout is the report
    assert "posdiag: loading" not in text
    assert all(line.startswith("posdiag: ") and line.endswith((" s)", " ...")) for line in finished), err


def test_piped_synthetic_kernels_are_whole_and_quiet(tmp_path):
    report = tmp_path / "r.json"
    code, text, err = piped(["kernels", "--synthetic", "--q-len", "32", "--repeats", "1", "--json", report], tmp_path)
    assert code == 0, text + err
    assert not cut(text) and "USDT" not in err and "profiler" not in err, err
    for record in json.loads(report.read_text())["synthetic"]:
        for r in record["results"]:
            if r["status"] == "ok":
                assert f"{r['error']:.2e}" in text and r["name"] in text and r["verdict"].split()[0] in text


# ------------------------------------------------------------------ every report kind, 80-column terminal
def terminal(width: int = 80) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)


def short(cell: str) -> str:
    from posdiag.report.fit import NUMBER

    return NUMBER.sub(lambda m: f"{float(m.group()):.3g}", cell)


@pytest.fixture(scope="module")
def llama_report():
    from posdiag.api import run_checks
    from posdiag.model.loading import load_subject

    subject = load_subject(str(ROOT / "fixtures" / "llama-tiny"))
    return run_checks(subject, ["shuffle", "positions", "batch", "cache", "kernels"])


def assert_terminal_whole(text: str, cells: list[str], width: int = 80):
    assert not cut(text), cut(text)
    assert max(len(line) for line in text.splitlines()) <= width
    words = {w.rstrip(":") for w in text.replace("│", " ").split()} | set(text.replace("│", " ").split())
    for cell in cells:
        whole = all(w in words for w in cell.split()) or all(w in words for w in short(cell).split())
        assert whole, f"{cell!r} (short: {short(cell)!r}) is not whole at {width} columns"


def test_check_report_at_80_columns(llama_report):
    from posdiag.report.console import render

    out = terminal()
    render(llama_report, out)
    text = out.file.getvalue()
    assert_terminal_whole(text, table_cells(llama_report.to_dict()))
    for check in llama_report.checks:
        assert f"{check.name}" in text and check.status.value.upper() in text


def test_quiet_and_narrow_terminal_keep_words_whole(llama_report):
    from posdiag.report.console import render

    for width in (60, 80):
        out = terminal(width)
        render(llama_report, out)
        assert_terminal_whole(out.file.getvalue(), table_cells(llama_report.to_dict()), width)


def test_synthetic_and_rope_at_80_columns():
    from posdiag.report.rope_console import render_rope_static
    from posdiag.report.synthetic_console import render_synthetic
    from posdiag.tools import rope_math
    from posdiag.tools.synthetic import Shape, judge_synthetic, synthetic

    shape = Shape(q_len=16, k_len=16, head_dim=16, heads=2, kv_heads=2, batch=1)
    results = synthetic(shape, memory=False, repeats=1)
    verdicts = judge_synthetic(results, "float32")
    out = terminal()
    render_synthetic(out, shape, results, verdicts)
    text = out.file.getvalue()
    assert_terminal_whole(text, [f"{r.error:.2e}" for r in results if r.status == "ok"])
    for v in verdicts.values():
        assert v.split()[0] in text

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "fixtures" / "llama-tiny")
    out = terminal()
    render_rope_static(out, "fixtures/llama-tiny", config, rope_math.analyze_config(config, None))
    assert not cut(out.file.getvalue())


def test_compare_at_80_columns():
    from posdiag.api import versions
    from posdiag.model.loading import from_module
    from posdiag.options import RunOptions
    from posdiag.ports.layers import compare_subjects
    from posdiag.report.compare_console import render_compare
    from posdiag.results import Report
    from posdiag.testing import zoo

    ref, cand = zoo.tiny_model("llama"), zoo.tiny_model("llama")
    cand.load_state_dict(ref.state_dict())
    comparison = compare_subjects(from_module(ref), from_module(cand), RunOptions(seq_len=32))
    report = Report(model=from_module(ref).info, checks=(comparison.result,), versions=versions())
    out = terminal()
    render_compare(report, out)
    text = out.file.getvalue()
    assert_terminal_whole(text, [str(c) for t in comparison.result.tables for row in t.rows for c in row])
    assert comparison.result.status.value.upper() in text


# ------------------------------------------------------------------ the CI gate from its first run
def test_first_run_writes_the_baseline_and_the_junit_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = ROOT / "fixtures" / "llama-tiny"
    first = invoke("check", model, "--only", "load,shuffle", "--junit", "posdiag.xml", "--baseline", "base.json", "-q")
    assert first.exit_code == 0, first.output
    assert "SKIP baseline: no baseline yet: this run's report was written to 'base.json'" in first.output
    assert json.loads((tmp_path / "base.json").read_text())["exit_code"] == 0
    cases = {c.get("name") for c in ET.parse(tmp_path / "posdiag.xml").getroot().iter("testcase")}
    assert cases == {"load", "shuffle", "baseline"}
    again = invoke("check", model, "--only", "load,shuffle", "--junit", "posdiag.xml", "--baseline", "base.json", "-q")
    assert again.exit_code == 0 and "PASS baseline: no regression" in again.output


def test_failing_first_run_writes_no_baseline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("shuffle", ROOT / "fixtures" / "gpt2-tiny-zeroed-wpe", "-q")
    assert result.exit_code == 1
    result = invoke("check", ROOT / "fixtures" / "gpt2-tiny-zeroed-wpe", "--only", "shuffle", "--baseline", "b.json",
                    "--junit", "j.xml", "-q")
    assert result.exit_code == 1 and "none written" in result.output
    assert not (tmp_path / "b.json").exists() and (tmp_path / "j.xml").is_file()


# ------------------------------------------------------------------ usage errors before any work
@pytest.mark.parametrize("args, message", [
    (["--format", "xml"], "--format xml"),
    (["--baseline", "missing.json", "--baseline-required"], "does not exist"),
    (["--baseline-required"], "needs --baseline"),
    (["--json", "no/such/folder/r.json"], "does not exist"),
    (["--junit", "."], "is a directory"),
    (["--save-baseline", "no/such/folder/b.json"], "does not exist"),
    (["--only", "shuffle", "--skip", "shuffle"], "no check left to run"),
    (["--json", "-", "--junit", "-"], "--json - and --junit -: only one output can go to stdout"),
])
def test_usage_errors_come_before_loading(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def no_load(settings):
        raise AssertionError("the model was loaded before a usage error")

    monkeypatch.setattr("posdiag.cli.check.load_model", no_load)
    result = invoke("check", ROOT / "fixtures" / "llama-tiny", *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posdiag: error:") and message in lines[0], result.output


def test_unknown_kernel_implementation_is_one_line_before_loading(monkeypatch):
    from posdiag.checks.kernels.scenarios import unknown_implementation

    def no_load(settings):
        raise AssertionError("the model was loaded before a usage error")

    monkeypatch.setattr("posdiag.cli.kernels.load_model", no_load)
    result = invoke("kernels", ROOT / "fixtures" / "llama-tiny", "--impl", "sdpa[math],bogus", "-q")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posdiag: error: --impl bogus: not an attention implementation")
    assert "sdpa[math]" in lines[0] and lines[0].endswith("or a hub kernel ORG/REPO)"), lines[0]  # whole, not cut
    for name in ("eager", "sdpa", "sdpa[cudnn]", "flash_attention_2", "flex_attention", "kernels-community/flash-attn"):
        assert unknown_implementation(name) is None, name
    assert unknown_implementation("sdpa[fast]") and unknown_implementation("flash")


@pytest.mark.parametrize("spec", ["fixtures/llama-tiny-typo", "./fixtures/llama-tiny-typo", "fixtures/a/b"])
def test_mistyped_local_path_is_one_line_at_once(spec):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "posdiag", "shuffle", spec], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0"}, timeout=60)
    elapsed = time.perf_counter() - start
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and "hub" not in lines[0], done.stderr
    assert elapsed < 2.0, f"{elapsed:.2f} s"


@pytest.mark.parametrize("as_file", [False, True], ids=["inline", "file"])
def test_text_longer_than_the_context_names_the_text(fixtures_dir, tmp_path, as_file):
    """window-text reads characters (a 1024-token context): 1200 of them are too many, and the error says so in
    the text's terms, never blaming a --seq-len nobody passed (inline, such a text is no file name either)."""
    text = "the cat sat on the mat. " * 50
    given = text
    if as_file:
        given = tmp_path / "long.txt"
        given.write_text(text)
    result = invoke("check", fixtures_dir / "window-text", "--text", given, "--only", "shuffle", "-q")
    assert result.exit_code == 2, result.output
    loads, *lines = result.output.strip().splitlines()  # the error, after the line saying the model loads
    assert loads.startswith("posdiag: loading ") and len(lines) == 1 and "--seq-len" not in lines[0], result.output
    assert "--text gives 1200 tokens" in lines[0] and "declared context of 1024 tokens" in lines[0], result.output


def test_debug_adds_the_traceback_and_keeps_exit_2():
    result = invoke("shuffle", ROOT / "fixtures" / "llama-tiny", "--seq-len", "100000", "--debug")
    assert result.exit_code == 2
    assert "Traceback" in result.output and "posdiag: error: --seq-len 100000" in result.output


# ------------------------------------------------------------------ Ctrl-C during the checks
# The child: SIGINT back to Python's own handler first (a suite run under nohup, in a background job or by some CI
# runners inherits SIGINT ignored, and Ctrl-C is what is tested), then posdiag with every check after the first held
# until the signal comes; the marker says the first check has finished.
INTERRUPTIBLE = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from posdiag import api
real = api._run_one
marker = pathlib.Path(sys.argv[1])
def slow(subject, name, options, *reset):
    result = real(subject, name, options, *reset)
    marker.write_text(name)
    time.sleep(600)
    return result
api._run_one = slow
from posdiag.cli import app
sys.argv = ["posdiag", *sys.argv[2:]]
app()
"""


def test_sigint_during_checks_is_exit_130_with_a_partial_report(tmp_path):
    """Ctrl-C after the first check: exit 130, and the panel, the JSON and the JUnit file say so. Bounded however
    loaded the machine (the child is killed on every path: a failure never leaves it running)."""
    marker, report, junit = tmp_path / "started", tmp_path / "r.json", tmp_path / "r.xml"
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE, str(marker), "check", "fixtures/llama-tiny",
                             "--only", "load,shuffle", "--json", str(report), "--junit", str(junit)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 300  # importing torch and loading the model on a busy machine
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not marker.exists():
            proc.kill()
            pytest.fail(f"the first check never finished (exit {proc.poll()}): {proc.communicate()}")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines()[-1] == "posdiag: interrupted"
    assert "INCOMPLETE" in out and "exit code 130" in out and "exit code 2" not in out, out
    data = json.loads(report.read_text())
    assert data["incomplete"] is True and data["exit_code"] == 130
    assert "incomplete" in {c.get("name") for c in ET.parse(junit).getroot().iter("testcase")}


# ------------------------------------------------------------------ help, config display, plugin
def test_help_is_whole_in_80_columns():
    for args in (["--help"], ["check", "--help"], ["kernels", "--help"]):
        result = runner.invoke(app, args, env={"COLUMNS": "80"})
        assert result.exit_code == 0
        assert "…" not in result.output and "<bool>" not in result.output
    text = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "80"}).output
    for option in ("--trust-remote-code", "--attn-implementation", "--baseline-required", "--baseline-margin"):
        assert option in text
    assert "--sweep-to" in runner.invoke(app, ["kernels", "--help"]).output


def test_help_names_arguments_one_way_and_only_the_options_a_command_has(fixtures_dir):
    """Usage lines write a required argument bare and an optional one in brackets, every command alike; each help
    ends with its exit codes and names --fail-on/--require only where the command takes them; MODEL names .gguf."""
    usage = {"shuffle": "[MODEL]", "check": "[MODEL]", "rope": "MODEL", "kernels": "[MODEL]",
             "compare": "REFERENCE [CANDIDATE]"}
    for command, arguments in usage.items():
        text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert text.splitlines()[0].endswith(f" {command} [OPTIONS] {arguments}"), text.splitlines()[0]
        assert "Exit codes:" in text and "130 interrupted" in text, command
        options = {line.split()[0] for line in text.splitlines() if line.strip().startswith("--")}
        for gate in ("--fail-on", "--require"):
            assert (gate in text) == (gate in options), (command, gate)
        if command != "compare":
            assert ".gguf file" in text.split("Options:")[0], command
    assert "--fail-on" not in runner.invoke(app, ["kernels", "--help"]).output
    result = invoke("shuffle", fixtures_dir / "make_fixtures.py")
    assert result.exit_code == 2 and "a .gguf file" in result.output, result.output


def test_show_config_shows_only_the_same_from_either_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typed = invoke("check", "fixtures/llama-tiny", "--only", "shuffle,load", "--show-config").output
    (tmp_path / "posdiag.toml").write_text('only = ["shuffle", "load"]\n')
    from_file = invoke("check", "fixtures/llama-tiny", "--show-config").output
    row = next(line for line in typed.splitlines() if "│ only" in line)
    assert "['shuffle', 'load']" in row
    assert "['shuffle', 'load']" in next(line for line in from_file.splitlines() if "│ only" in line)


def test_junit_is_written_when_the_run_ends_before_any_check(fixtures_dir, tmp_path):
    """--seq-len past the declared context ends the run at once (exit 2), but the JUnit file a CI job uploads is
    still there, saying why."""
    junit = tmp_path / "posdiag.xml"
    result = CliRunner().invoke(app, ["check", str(fixtures_dir / "llama-tiny"), "--seq-len", "100000", "--junit",
                                      str(junit), "-q"])
    assert result.exit_code == 2, result.output
    text = junit.read_text()
    assert 'name="load"' in text and "UsageOrLoadError" in text and "exceeds the model's declared context" in text


def test_a_log_without_a_terminal_gets_one_line_per_finished_check(fixtures_dir):
    """In a CI log (stderr no terminal) the spinner shows nothing: each finished check is one plain line on stderr
    with its verdict and seconds; -q keeps stderr silent."""
    result = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle,causal")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("posdiag: ") and " loading " not in line]
    assert [line.split()[1:3] for line in lines] == [["shuffle", "PASS"], ["causal", "PASS"]], result.stderr
    assert all(line.endswith(" s)") for line in lines)
    quiet = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle", "-q")
    assert "posdiag: shuffle" not in quiet.stderr


def test_junit_on_stdout_is_all_that_stdout_holds(fixtures_dir):
    """`--junit -` pipes the XML alone (the console view moves to stderr, as for `--json -`)."""
    result = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle", "--junit", "-")
    assert result.exit_code == 0, result.output
    assert [c.get("name") for c in ET.fromstring(result.stdout).iter("testcase")] == ["shuffle"]
    assert "exit code 0" in result.stderr


def test_format_json_points_to_the_json_option(fixtures_dir):
    result = invoke("check", fixtures_dir / "llama-tiny", "--format", "json")
    assert result.exit_code == 2 and "--json -" in result.output, result.output
