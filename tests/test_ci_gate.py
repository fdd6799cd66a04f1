"""The CI-gate surface: JUnit, GitHub annotations, config file precedence, baselines, API, pytest plugin."""

import json
import xml.etree.ElementTree as ET

import pytest
import yaml
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.report.github import format_github
from posdiag.report.junit import format_junit
from posdiag.results import CheckResult, ModelInfo, Report, Status
from posdiag.testing import zoo

runner = CliRunner()
MODEL = ModelInfo(id="org/m<&>", family="llama", kind="causal", position_kind="rope", dtype="float32", device="cpu")


def invoke(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


def test_junit_parses_back_with_odd_characters():
    checks = (CheckResult("shuffle", Status.FAIL, "residual 1e-7 <\x00bad & \x1b[31m>", {"ratio": 1.2}),
              CheckResult("load", Status.PASS, "ok"), CheckResult("rope", Status.SKIP, "not rope"))
    root = ET.fromstring(format_junit(Report(model=MODEL, checks=checks)))
    assert root.get("tests") == "3" and root.get("failures") == "1" and root.get("skipped") == "1"
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert cases["shuffle"].get("classname") == "org/m<&>"
    assert "ratio=1.2" in cases["shuffle"].find("failure").text
    assert cases["rope"].find("skipped") is not None and cases["load"].find("failure") is None


def test_junit_file_from_the_cli(fixtures_dir, tmp_path):
    out = tmp_path / "r.xml"
    result = invoke("check", fixtures_dir / "gpt2-tiny-missing-wpe", "--only", "load,shuffle", "--junit", out, "-q")
    assert result.exit_code == 1
    root = ET.parse(out).getroot()
    failed = [c.get("name") for c in root.iter("testcase") if c.find("failure") is not None]
    assert failed == ["load"]


def test_github_annotations():
    checks = (CheckResult("shuffle", Status.FAIL, "50%\nnever entered"), CheckResult("rope", Status.WARN, "w"),
              CheckResult("load", Status.PASS, "ok"))
    text = format_github(Report(model=MODEL, checks=checks))
    assert text.splitlines() == ["::error title=posdiag shuffle (org/m<&>)::50%25%0Anever entered",
                                 "::warning title=posdiag rope (org/m<&>)::w"]


def test_github_format_auto_detected(fixtures_dir, monkeypatch):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result = invoke("shuffle", fixtures_dir / "gpt2-tiny-zeroed-wpe", "-q")
    assert result.exit_code == 1 and "::error title=posdiag shuffle" in result.output


def write_config(tmp_path, body):
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\n\n[tool.posdiag]\n" + body)


def test_config_file_precedence(fixtures_dir, tmp_path, monkeypatch):
    write_config(tmp_path, f'model = "{fixtures_dir / "llama-tiny"}"\nseq-len = 16\nseed = 5\n'
                           '[tool.posdiag.checks.rope]\ntarget_length = 4096\n')
    monkeypatch.chdir(tmp_path)
    shown = invoke("check", "--seed", "7", "--show-config")
    assert shown.exit_code == 0
    lines = {l.split()[1]: l for l in shown.output.splitlines() if l.startswith("│ ") and len(l.split()) > 3}
    assert "16" in lines["seq-len"] and "config file" in lines["seq-len"]
    assert "7" in lines["seed"] and "command line" in lines["seed"]
    assert "default" in lines["permutations"]
    assert "checks.rope.target_length" in shown.output
    ran = invoke("check", "--only", "shuffle", "--json", "-", "-q")  # MODEL comes from the file
    data = json.loads(ran.stdout[ran.stdout.index("{"):])
    assert ran.exit_code == 0 and data["checks"][0]["details"]["seq_len"] == 16


def test_config_file_errors_are_exit_2(tmp_path, monkeypatch):
    write_config(tmp_path, "sequence = 3\n")
    monkeypatch.chdir(tmp_path)
    result = invoke("check", "--show-config")
    assert result.exit_code == 2 and "unknown setting 'sequence'" in result.output


def test_no_model_anywhere_is_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("check")
    assert result.exit_code == 2 and "no MODEL" in result.output


def test_baseline_regression_fails_even_when_checks_pass(fixtures_dir, tmp_path):
    base = tmp_path / "base.json"
    first = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle", "--save-baseline", base, "-q")
    assert first.exit_code == 0
    same = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle", "--baseline", base, "-q")
    assert same.exit_code == 0 and "no regression" in same.output
    data = json.loads(base.read_text())
    data["checks"][0]["metrics"]["ratio"] *= 1000  # the stored model had a far stronger signal
    base.write_text(json.dumps(data))
    worse = invoke("check", fixtures_dir / "llama-tiny", "--only", "shuffle", "--baseline", base, "-q")
    assert worse.exit_code == 1
    assert "PASS shuffle" in worse.output and "FAIL baseline" in worse.output and "shuffle.ratio" in worse.output


def test_baseline_that_is_not_a_report_is_exit_2(fixtures_dir, tmp_path):
    bad = tmp_path / "b.json"
    bad.write_text("[]")
    assert invoke("check", fixtures_dir / "llama-tiny", "--baseline", bad).exit_code == 2


def test_python_api_on_an_in_memory_model():
    from posdiag import check_model

    model = zoo.tiny_model("qwen2")
    report = check_model(model, ["shuffle"])
    assert report.exit_code == 0 and report.check("shuffle").status is Status.PASS
    zoo.remove_positions(model, "qwen2")
    assert check_model(model, ["shuffle"]).exit_code == 1


@pytest.mark.parametrize("path", ["examples/github-workflow.yml", ".pre-commit-hooks.yaml"])
def test_example_ci_files_are_valid_yaml(path):
    from pathlib import Path

    data = yaml.safe_load((Path(__file__).parent.parent / path).read_text())
    assert data


def test_the_api_keeps_transformers_notices_about_its_own_calls_out_of_the_callers_output():
    """state runs generate() assisted by a draft (the model itself), and transformers answers that call with a
    deprecation notice about its own internals. Through the API (a user's test) posdiag holds such notices back
    around its calls only: the caller's logging level is as it was, and its own warnings still show."""
    import logging

    import transformers

    from posdiag.api import check_model

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    library = logging.getLogger("transformers")
    kept, verbosity = Kept(), transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # a user's default (the suite runs at error)
    transformers.utils.logging.warning_once.cache_clear()  # each notice is shown once per process
    library.addHandler(kept)
    try:
        report = check_model(zoo.tiny_model("llama"), checks=["state"])
        assert report.check("state").status is Status.PASS, report.check("state").summary
        assert not [m for m in kept.messages if "deprecated" in m], kept.messages
        assert transformers.logging.get_verbosity() == logging.WARNING  # the caller's level, untouched
        transformers.logging.get_logger("transformers.generation.utils").warning("the caller's own notice")
        assert kept.messages == ["the caller's own notice"]
    finally:
        library.removeHandler(kept)
        transformers.logging.set_verbosity(verbosity)
