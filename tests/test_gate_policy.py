"""The gate: --fail-on / --require decided in Report.exit_code, a run that judged nothing never reads as OK,
internal errors (exit 3) kept apart from findings (exit 1), and the same policy in every output."""

import io
import json
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console
from typer.testing import CliRunner

import posdiag.checks.shuffle
from posdiag.cli import app
from posdiag.report.console import render
from posdiag.report.github import format_github
from posdiag.report.junit import format_junit
from posdiag.results import CheckResult, GatePolicy, ModelInfo, Report, Status

runner = CliRunner()
MODEL = ModelInfo(id="m", family="llama", kind="causal", position_kind="rope", dtype="float32", device="cpu")


def invoke(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"}, **kw)  # panel lines unwrapped


def report(*statuses, policy=None, **kw):
    checks = tuple(CheckResult(name, s, f"{name} said {s.value}") for name, s in statuses)
    return Report(model=MODEL, checks=checks, policy=policy or GatePolicy(), **kw)


def panel(rep: Report) -> str:
    out = io.StringIO()
    render(rep, Console(file=out, width=200, color_system=None), verbose_tables=False)
    return out.getvalue()


# ---------------------------------------------------------------- the policy as data


def test_exit_code_follows_the_policy():
    mixed = [("load", Status.PASS), ("rope", Status.WARN), ("cache", Status.SKIP)]
    assert report(*mixed).exit_code == 0
    assert report(*mixed, policy=GatePolicy(fail_on=frozenset({Status.WARN}))).exit_code == 1
    assert report(*mixed, policy=GatePolicy(fail_on=frozenset({Status.SKIP}))).exit_code == 1
    assert report(*mixed, policy=GatePolicy(require=("load",))).exit_code == 0
    refused = report(*mixed, policy=GatePolicy(require=("load", "cache", "kernels")))
    assert refused.exit_code == 1
    assert [(r.check, r.status, r.why) for r in refused.gate] == [
        ("cache", "skip", "required, but skip"), ("kernels", "missing", "required, but it did not run")]
    with pytest.raises(ValueError):
        GatePolicy(fail_on=frozenset({Status.FAIL}))


def test_internal_errors_are_exit_3_and_findings_win():
    assert report(("shuffle", Status.ERROR), ("load", Status.PASS)).exit_code == 3
    assert report(("shuffle", Status.ERROR), ("load", Status.FAIL)).exit_code == 1
    skip_refused = GatePolicy(fail_on=frozenset({Status.SKIP}))
    assert report(("shuffle", Status.ERROR), ("table", Status.SKIP), policy=skip_refused).exit_code == 1
    assert report(("shuffle", Status.ERROR), incomplete=True).exit_code == 130


def test_api_policy_names_are_validated():
    from posdiag.api import gate_policy
    from posdiag.errors import PosdiagError

    assert gate_policy("warn, SKIP", "cache,shuffle") == GatePolicy(frozenset({Status.WARN, Status.SKIP}),
                                                                     ("cache", "shuffle"))
    assert gate_policy(["skip"], None) == GatePolicy(frozenset({Status.SKIP}))
    with pytest.raises(PosdiagError, match="--fail-on fail"):
        gate_policy("fail", None)
    with pytest.raises(PosdiagError, match="--require cachee: unknown check"):
        gate_policy(None, "cachee")


# ---------------------------------------------------------------- the summary panel


def test_panel_says_ok_only_when_every_check_passed():
    assert "OK — no position bug found" in panel(report(("load", Status.PASS), ("shuffle", Status.PASS)))
    mixed = panel(report(("load", Status.PASS), ("shuffle", Status.PASS), ("rope", Status.WARN),
                         ("table", Status.SKIP)))
    assert "OK" not in mixed and "no position bug found" not in mixed
    assert "2 pass · 1 skip · 1 warn — not a full bill of health" in mixed
    assert "not passed: rope (warn), table (skip)" in mixed and "exit code 0" in mixed
    blind = panel(report(("cache", Status.SKIP), ("table", Status.SKIP)))
    assert "OK" not in blind and "2 skip — nothing was judged" in blind
    # n/a is counted apart: every check that applies passed -> OK
    applicable = panel(report(("load", Status.PASS), ("shuffle", Status.PASS), ("table", Status.NA)))
    assert "OK — no position bug found" in applicable and "2 pass · 1 n/a" in applicable
    nothing = panel(report(("table", Status.NA)))
    assert "OK" not in nothing and "1 n/a — nothing was judged" in nothing
    warned = panel(report(("rope", Status.WARN), ("copy", Status.WARN)))
    assert "OK" not in warned and "2 warn — not a full bill of health" in warned


def test_panel_names_findings_refusals_and_internal_errors_apart():
    err = CheckResult("shuffle", Status.ERROR, "posdiag could not run this check: ...",
                      details={"error": "RuntimeError: boom"})
    both = panel(Report(model=MODEL, checks=(CheckResult("load", Status.FAIL, "table missing"), err)))
    assert "FAILED — position bug found by load" in both
    assert "posdiag could not run shuffle: RuntimeError: boom; please report" in both
    assert "FAILED — position bug found by shuffle" not in both and "exit code 1" in both
    refused = panel(report(("cache", Status.SKIP), policy=GatePolicy(require=("cache",))))
    assert "GATE FAILED — cache required, but skip" in refused and "require cache · exit code 1" in refused


# ---------------------------------------------------------------- the command line


def test_not_applicable_is_not_ok_alone_and_not_refused_by_fail_on_skip(fixtures_dir):
    """`table` on a RoPE model does not apply: alone it judged nothing (never OK); --fail-on skip does not refuse it,
    --require table does (it did not pass)."""
    blind = invoke("check", fixtures_dir / "llama-tiny", "--only", "table")
    assert blind.exit_code == 0, blind.output
    assert "N/A" in blind.output and "OK" not in blind.output and "nothing was judged" in blind.output
    assert invoke("check", fixtures_dir / "llama-tiny", "--only", "table", "--fail-on", "skip").exit_code == 0
    refused = invoke("check", fixtures_dir / "llama-tiny", "--only", "table", "--require", "table")
    assert refused.exit_code == 1
    assert "GATE FAILED — table required, but n/a" in refused.output


def test_fail_on_skip_refuses_a_skip():
    assert report(("table", Status.SKIP), ("load", Status.NA)).exit_code == 0
    refused = report(("table", Status.SKIP), ("load", Status.NA), policy=GatePolicy(fail_on=frozenset({Status.SKIP})))
    assert [(r.check, r.why) for r in refused.gate] == [("table", "skip, and the gate fails on skip")]


def test_require_cache_on_an_encoder(fixtures_dir):
    result = invoke("check", fixtures_dir / "bert-tiny", "--only", "cache", "--require", "cache", "--json", "-")
    assert result.exit_code == 1
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["schema"] == 1 and data["checks"][0]["status"] == "n/a"  # an encoder keeps no cache by design
    assert data["policy"] == {"fail_on": [], "require": ["cache"]}
    (reason,) = data["gate"]["reasons"]
    assert reason["check"] == "cache" and reason["kind"] == "policy" and reason["why"] == "required, but n/a"
    assert reason["summary"] == data["checks"][0]["summary"] and data["gate"]["passed"] is False
    assert "GATE FAILED — cache required, but n/a" in result.stderr


def test_bad_policy_is_a_usage_error(fixtures_dir):
    result = invoke("check", fixtures_dir / "llama-tiny", "--fail-on", "warn,fail")
    assert result.exit_code == 2 and "--fail-on fail" in result.output


def boom(subject, options):
    raise RuntimeError("boom inside the check\nsecond line")


def test_internal_error_exits_3_with_its_own_wording(fixtures_dir, monkeypatch):
    monkeypatch.setattr(posdiag.checks.shuffle, "run", boom)
    result = invoke("shuffle", fixtures_dir / "llama-tiny", "--json", "-")
    assert result.exit_code == 3
    assert "posdiag could not run shuffle: RuntimeError: boom inside the check; please report" in result.stderr
    assert "FAILED" not in result.stderr
    data = json.loads(result.stdout[result.stdout.index("{"):])
    check = data["checks"][0]
    assert check["status"] == "error" and check["details"]["exception"] == "RuntimeError"
    assert data["exit_code"] == 3 and data["gate"]["reasons"][0]["kind"] == "internal"


def test_fail_together_with_an_error_is_exit_1_and_says_both(fixtures_dir, monkeypatch):
    monkeypatch.setattr(posdiag.checks.shuffle, "run", boom)
    result = invoke("check", fixtures_dir / "gpt2-tiny-missing-wpe", "--only", "load,shuffle")
    assert result.exit_code == 1
    assert "FAILED — position bug found by load" in result.output
    assert "posdiag could not run shuffle: RuntimeError: boom inside the check; please report" in result.output


def test_fail_on_from_the_config_file(fixtures_dir, tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.posdiag]\nmodel = "{fixtures_dir / "llama-tiny"}"\nfail-on = "skip"\nrequire = ["table"]\n')
    monkeypatch.chdir(tmp_path)
    shown = invoke("check", "--show-config")
    assert shown.exit_code == 0 and "fail-on" in shown.output and "require" in shown.output
    result = invoke("check", "--only", "table", "-q")
    assert result.exit_code == 1 and "GATE FAILED — table required, but n/a" in result.output
    typed = invoke("check", "--only", "table", "--fail-on", "warn", "--require", "load", "-q")
    assert typed.exit_code == 1 and "required, but it did not run" in typed.output  # the command line wins


# ---------------------------------------------------------------- JUnit, GitHub, API, plugin


def test_junit_skip_is_skipped_with_the_reason_and_refusals_are_failures():
    plain = ET.fromstring(format_junit(report(("load", Status.PASS), ("cache", Status.SKIP))))
    cases = {c.get("name"): c for c in plain.iter("testcase")}
    assert cases["cache"].find("skipped").get("message") == "cache said skip"
    assert plain.get("skipped") == "1" and plain.get("failures") == "0"
    strict = GatePolicy(fail_on=frozenset({Status.SKIP}), require=("kernels",))
    root = ET.fromstring(format_junit(report(("load", Status.PASS), ("cache", Status.SKIP), policy=strict)))
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert cases["cache"].find("skipped") is None
    assert cases["cache"].find("failure").get("type") == "GatePolicy"
    assert cases["kernels"].find("failure").get("message") == "required, but it did not run"
    assert root.get("failures") == "2" and root.get("skipped") == "0" and root.get("tests") == "3"
    err = ET.fromstring(format_junit(report(("shuffle", Status.ERROR))))
    assert err.find("testcase/error").get("type") == "InternalError" and err.get("failures") == "0"


def test_junit_warn_is_visible_and_a_failure_when_refused():
    root = ET.fromstring(format_junit(report(("batch", Status.WARN), ("table", Status.NA))))
    cases = {c.get("name"): c for c in root.iter("testcase")}
    warn = cases["batch"]
    assert warn.find("skipped") is None and warn.find("failure") is None
    props = {p.get("name"): p.get("value") for p in warn.iter("property")}
    assert props == {"status": "warn", "warning": "batch said warn"}
    assert warn.find("system-out").text.startswith("WARN: batch said warn")
    assert cases["table"].find("skipped").get("type") == "NotApplicable"  # not judged: never a passed testcase
    assert root.get("skipped") == "1" and root.get("failures") == "0"
    refused = ET.fromstring(format_junit(report(("batch", Status.WARN),
                                                policy=GatePolicy(fail_on=frozenset({Status.WARN})))))
    node = refused.find("testcase/failure")
    assert node.get("type") == "GatePolicy" and "warn, and the gate fails on warn" in node.get("message")


def test_github_annotations_follow_the_policy():
    text = format_github(report(("rope", Status.WARN), ("cache", Status.SKIP),
                                policy=GatePolicy(fail_on=frozenset({Status.SKIP}))))
    assert text.splitlines() == ["::warning title=posdiag rope (m)::rope said warn",
                                 "::error title=posdiag cache (m)::skip, and the gate fails on skip: cache said skip"]
    plain = format_github(report(("rope", Status.WARN), ("cache", Status.SKIP), ("table", Status.NA)))
    assert plain.splitlines() == ["::warning title=posdiag rope (m)::rope said warn",
                                  "::notice title=posdiag cache (m)::cache said skip"]  # n/a: nothing to annotate


def test_python_api_takes_the_policy():
    from posdiag import check_model
    from posdiag.testing import zoo

    model = zoo.tiny_model("llama")
    assert check_model(model, ["table"]).exit_code == 0
    strict = check_model(model, ["table"], fail_on="skip")
    assert strict.exit_code == 0 and strict.policy.fail_on == {Status.SKIP}  # table does not apply to RoPE: n/a
    assert check_model(model, ["table"], require="table").exit_code == 1


PLUGIN_TEST = '''
from posdiag.testing import zoo

def test_default_policy(posdiag):
    posdiag.assert_ok(zoo.tiny_model("llama"), checks=["table"])

def test_required(posdiag):
    posdiag.assert_ok(zoo.tiny_model("llama"), checks=["table"], require=["table"])
'''

HEALTHY_AND_BROKEN = '''
from posdiag.testing import zoo

def test_healthy(posdiag):
    posdiag.assert_ok(zoo.tiny_model("llama"), checks=["shuffle"])

def test_broken(posdiag):
    model = zoo.tiny_model("llama")
    zoo.remove_positions(model, "llama")
    posdiag.assert_ok(model, checks=["load", "shuffle"])
'''

DOCS_EXAMPLE = '''
from posdiag.testing import zoo

def test_positions(posdiag):
    posdiag.assert_ok(zoo.tiny_model("llama"), require=["shuffle", "cache"])  # docs/ci.md, on a fresh Llama
    posdiag.assert_ok(zoo.tiny_model("llama"))  # every check: fit is n/a on an untrained model built in memory
'''


PLUGIN_DEFAULTS = '''
import pytest
from posdiag.results import CheckResult, Report, Status
from posdiag.testing.pytest_plugin import PosdiagFixture

class Canned(PosdiagFixture):
    def __init__(self, status):
        self.status = status

    def check(self, model, checks=None, fail_on=(), require=None, **kwargs):
        from posdiag.api import gate_policy
        from tests_info import MODEL
        return Report(MODEL, (CheckResult("shuffle", self.status, "said so"),), policy=gate_policy(fail_on, require))

@pytest.mark.parametrize("status", ["skip", "warn"])
def test_refused_by_default(status):
    Canned(Status(status)).assert_ok(None)

def test_allowed_when_told():
    Canned(Status.SKIP).assert_ok(None, allow_skips=True)
    Canned(Status.WARN).assert_ok(None, allow_warnings=True)
    Canned(Status.NA).assert_ok(None)
'''


def test_pytest_plugin_respects_the_policy(pytester):
    """The fixture reads a policy as the command line does (table is n/a on RoPE: OK by default, a FAIL when
    required); it passes a healthy model and fails a broken one, listing only the problems (load's PASS is not among
    them); and docs/ci.md's `require` example passes on a fresh Llama. One run of the three files: each inner run
    costs a process importing torch and transformers."""
    pytester.makepyfile(test_model=PLUGIN_TEST, test_plugin=HEALTHY_AND_BROKEN, test_docs_example=DOCS_EXAMPLE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-v")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*test_docs_example.py::test_positions PASSED*"])
    result.stdout.fnmatch_lines(["*test_model.py::test_default_policy PASSED*",
                                 "*test_model.py::test_required FAILED*"])
    result.stdout.fnmatch_lines(["*test_plugin.py::test_healthy PASSED*", "*test_plugin.py::test_broken FAILED*"])
    result.stdout.fnmatch_lines(["*posdiag found 1 problem(s)*", "*N/A table:*", "*gate: table required, but n/a*"])
    result.stdout.fnmatch_lines(["*posdiag found 1 problem(s)*", "*FAIL shuffle: outputs merely permute*"])
    assert "PASS load" not in result.stdout.str()


PLUGIN_REQUIRE = '''
import pytest
from posdiag.results import CheckResult, Report, Status
from posdiag.testing.pytest_plugin import PosdiagFixture

class Canned(PosdiagFixture):
    def __init__(self, **statuses):
        self.statuses = statuses

    def check(self, model, checks=None, fail_on=(), require=None, **kwargs):
        from posdiag.api import gate_policy
        from tests_info import MODEL
        results = tuple(CheckResult(n, Status(s), "said so") for n, s in self.statuses.items())
        return Report(MODEL, results, policy=gate_policy(fail_on, require))

def test_only_the_required_must_pass():
    canned = Canned(shuffle="pass", cache="pass", fit="skip", rope="warn", table="n/a")
    canned.assert_ok(None, require=["shuffle", "cache"])

def test_a_required_check_that_skips_fails():
    Canned(shuffle="pass", cache="skip").assert_ok(None, require=["shuffle", "cache"])

def test_a_fail_anywhere_fails():
    Canned(shuffle="pass", cache="pass", fit="fail").assert_ok(None, require=["shuffle", "cache"])

def test_told_to_refuse_skips_it_does():
    Canned(shuffle="pass", cache="pass", fit="skip").assert_ok(None, require=["shuffle", "cache"], allow_skips=False)
'''


def test_pytest_plugin_gates_skips_warnings_and_required_checks(pytester):
    """A SKIP or a WARN was not judged: assert_ok does not pass it by default (allow_skips / allow_warnings).
    `assert_ok(model, require=[...])` held every other check to PASS too (its default refusal of skips and warnings
    stayed on), so fit's SKIP failed the docs/ci.md example on every fresh decoder. Named, the required checks must
    PASS; the rest may skip, warn or be n/a; a FAIL anywhere, or a required check that skips, fails. One inner run
    of both files."""
    pytester.makepyfile(test_defaults=PLUGIN_DEFAULTS, test_require=PLUGIN_REQUIRE,
                        tests_info=f"from posdiag.results import ModelInfo\nMODEL = {MODEL!r}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-v")
    result.assert_outcomes(passed=2, failed=5)
    result.stdout.fnmatch_lines(["*test_defaults.py::test_allowed_when_told PASSED*",
                                 "*test_require.py::test_only_the_required_must_pass PASSED*"])
    result.stdout.fnmatch_lines(["*gate: shuffle skip, and the gate fails on skip*",
                                 "*gate: shuffle warn, and the gate fails on warn*"])
    result.stdout.fnmatch_lines(["*gate: cache required, but skip*", "*FAIL fit: said so*",
                                 "*gate: fit skip, and the gate fails on skip*"])


@pytest.mark.parametrize("fixture", ["bert-tiny", "t5-tiny"])
def test_encoders_and_seq2seq_read_ok_under_fail_on_skip(fixtures_dir, fixture):
    """Every check that does not run on BERT or T5 does not apply by design (n/a): `check --fail-on skip` passes
    and the panel reads OK, where fit's SKIP once made it "not a full bill of health" and failed the gate."""
    result = invoke("check", fixtures_dir / fixture, "--fail-on", "skip")
    assert result.exit_code == 0, result.output
    import re

    assert "OK — no position bug found" in result.output and not re.search(r"\d+ skip", result.output)
