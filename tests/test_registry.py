"""The check contract is verified, not prose: every check declares a CheckSpec, the registry is the one list of
names, a module that breaks the contract is refused on import with a precise error, `[checks.NAME]` config tables
are validated against the declared options, and the progress line counts the checks."""

from __future__ import annotations

import io
import pkgutil
import re
import time
from types import ModuleType

import pytest
from rich.console import Console
from typer.testing import CliRunner

from posdiag import checks
from posdiag.checks import CheckContractError, CheckSpec, Option
from posdiag.cli import app
from posdiag.errors import PosdiagError

runner = CliRunner()


def test_every_registered_check_declares_a_verified_spec():
    for name in checks.REGISTRY:
        spec = checks.registered(name)
        assert spec.name == name and spec.title and spec.proves and callable(spec.run)
    assert checks.ORDER == checks.REGISTRY and checks.available() == list(checks.REGISTRY)


def test_no_check_module_outside_the_registry():
    """A module dropped into posdiag/checks is never silently ignored: it is registered or it is a helper."""
    modules = {m.name for m in pkgutil.iter_modules(checks.__path__) if not m.name.startswith("_")}
    assert modules == set(checks.REGISTRY)


def fake(name="shuffle", **attrs) -> ModuleType:
    module = ModuleType(f"posdiag.checks.{name}")
    module.__dict__.update(attrs)
    return module


def run(subject, options):
    return None


@pytest.mark.parametrize(("module", "message"), [
    (fake(run=run), "no module-level `SPEC = CheckSpec(...)`"),
    (fake(SPEC={"name": "shuffle"}, run=run), "SPEC is a dict, not a CheckSpec"),
    (fake(SPEC=CheckSpec("batch", "t", "p"), run=run), "SPEC.name is 'batch', the module is 'shuffle'"),
    (fake(SPEC=CheckSpec("shuffle", "t", ""), run=run), "SPEC.proves must be one non-empty line"),
    (fake(SPEC=CheckSpec("shuffle", "t", "p", applies_to=("decoder",)), run=run), "SPEC.applies_to"),
    (fake(SPEC=CheckSpec("shuffle", "t", "p", options={"n": 3}), run=run), "SPEC.options['n'] must be an Option"),
    (fake(SPEC=CheckSpec("shuffle", "t", "p", baseline={"ratio": "up"}), run=run), "SPEC.baseline['ratio']"),
    (fake(SPEC=CheckSpec("shuffle", "t", "p")), "no `run(subject, options) -> CheckResult` function"),
    (fake(SPEC=CheckSpec("shuffle", "t", "p"), run=lambda subject: None), "must take (subject, options)"),
])
def test_a_broken_check_module_is_refused_naming_what_is_missing(module, message):
    with pytest.raises(CheckContractError) as caught:
        checks.verify(module, "shuffle")
    assert str(caught.value).startswith("check module posdiag.checks.shuffle: ") and message in str(caught.value)


def test_an_unregistered_module_is_refused():
    with pytest.raises(CheckContractError, match="not in posdiag.checks.REGISTRY"):
        checks.verify(fake("extra", SPEC=CheckSpec("extra", "t", "p"), run=run), "extra")


def test_config_tables_are_validated_against_the_declared_options():
    checks.validate_tables({"cache": {"decode_steps": 4}, "kernels": {"implementations": ["sdpa"]},
                            "rope": {"target_length": 32768}, "compare": {"long": True}}, "posdiag.toml")
    for tables, message in [({"cache": {"decode_step": 4}}, "[checks.cache]: unknown setting 'decode_step' "
                                                            "(known: decode_steps)"),
                            ({"cahce": {}}, "[checks.cahce]: unknown check (known: load, shuffle"),
                            ({"cache": {"decode_steps": "4"}}, "[checks.cache] decode_steps = '4': expected int"),
                            ({"cache": {"decode_steps": True}}, "expected int"),
                            ({"load": {"anything": 1}}, "unknown setting 'anything' (known: none)")]:
        with pytest.raises(PosdiagError) as caught:
            checks.validate_tables(tables, "posdiag.toml")
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_an_option_accepts_its_declared_types():
    assert Option(8, "why").accepts(3) and not Option(8, "why").accepts(3.5)
    assert Option(None, "why", (int,)).accepts(5) and not Option(None, "why", (int,)).accepts("5")


def test_unknown_config_key_is_one_line_exit_2(tmp_path, monkeypatch):
    (tmp_path / "posdiag.toml").write_text("[posdiag.checks.generate]\nnew_token = 3\n")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["check", "--show-config"])
    assert result.exit_code == 2, result.output
    assert "unknown setting 'new_token' (known: new_tokens)" in result.output and "Traceback" not in result.output


def test_check_list_prints_every_spec():
    result = runner.invoke(app, ["check", "--list"])
    assert result.exit_code == 0, result.output
    for name in checks.REGISTRY:
        spec = checks.registered(name)
        assert re.search(rf"^{name} +{re.escape(spec.title)}$", result.output, re.M), name
        assert f"proves: {spec.proves}" in result.output
    assert "[checks.cache]: decode_steps = 8" in result.output


def test_baseline_metrics_come_from_the_spec():
    from posdiag.baseline import watched_metrics

    assert watched_metrics("shuffle") == {"ratio": "higher"} == dict(checks.registered("shuffle").baseline)
    assert watched_metrics("causal") == {}


def test_checks_that_do_not_apply_to_an_encoder_are_na_on_one():
    """applies_to is what the checks do: on an encoder the others say so, each with its own reason."""
    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.options import RunOptions
    from posdiag.results import Status
    from posdiag.testing import zoo

    subject = from_module(zoo.tiny_model("bert"))
    assert subject.kind == "encoder"
    names = [n for n in checks.REGISTRY if not checks.registered(n).applies(subject.kind)]
    assert set(names) == {"cache", "generate", "state", "serving", "causal", "fit"}
    report = run_checks(subject, names, RunOptions(seq_len=8))
    # by design n/a, every one (fit scores next-token predictions, which an encoder does not make)
    expected = dict.fromkeys(("cache", "generate", "state", "serving", "causal", "fit"), Status.NA)
    assert all(c.status is expected[c.name] and c.summary for c in report.checks), report.checks


def test_progress_line_counts_checks_and_time():
    from posdiag.cli.check import _Progress

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    with console.status("running checks…") as status:
        progress = _Progress(["shuffle", "cache", "rope"], status.update)
        progress("shuffle")
        progress("cache")
        time.sleep(0.3)
    assert re.search(r"check 2/3 cache · \d+\.\d s", out.getvalue()), out.getvalue()


def test_a_spec_builds_its_checks_results():
    """SPEC.result names the result after the spec and keeps what the check hands it."""
    from posdiag.checks import CheckSpec
    from posdiag.results import Status, Table

    spec = CheckSpec(name="shift", title="t", proves="p")
    table = Table("t", ("a",), ((1,),))
    metrics, details = {"ratio": 2.0}, {"stack": "decoder"}
    result = spec.result(Status.WARN, "why", metrics, details, [table])
    assert (result.name, result.status, result.summary) == ("shift", Status.WARN, "why")
    assert result.metrics is metrics and result.details is details and result.tables == (table,)
    bare = spec.result(Status.NA, "n/a")
    assert bare.metrics == {} and bare.details == {} and bare.tables == ()
