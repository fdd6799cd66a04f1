"""Output formats and options are declared once. Formats (posdiag/report/formats.py): `--format` takes the
registry's stream formats, `emit` writes whatever the registry holds, and a new format needs only its class
and its entry. Options (cli/options.py groups, cli/groups.takes): every command gets each group's options
and the values typed reach the settings."""

import dataclasses
import inspect

import pytest
import typer

from posdiag.cli import app, validate
from posdiag.cli._flow import emit
from posdiag.cli.options import Settings
from posdiag.report import formats
from posdiag.report.github import format_github
from posdiag.report.json_report import format_json
from posdiag.report.junit import format_junit
from posdiag.results import CheckResult, ModelInfo, Report, Status

MODEL = ModelInfo(id="org/m", family="llama", kind="causal", position_kind="rope", dtype="float32", device="cpu")
REPORT = Report(model=MODEL, checks=(CheckResult("shuffle", Status.FAIL, "residual 4.1e-2, 9e5 x the noise floor",
                                                 {"ratio": 9e5}), CheckResult("rope", Status.PASS, "rotation ok")))


class Plain(formats.ReportFormat):
    """A format added the documented way: one class, one registry entry."""

    name, suffix, stream = "plain", ".txt", True
    describe = "one word per check"

    def format(self, report):
        return "".join(f"{c.name}={c.status.value}\n" for c in report.checks)


def test_every_format_renders_what_its_renderer_does():
    assert formats.FORMATS["json"].format(REPORT) == format_json(REPORT)
    assert formats.FORMATS["junit"].format(REPORT) == format_junit(REPORT)
    assert formats.FORMATS["github"].format(REPORT) == format_github(REPORT)
    text = formats.FORMATS["console"].format(REPORT)
    assert "FAIL" in text and "shuffle" in text and "\x1b[" not in text  # the console view, without styles
    assert all(line == line.rstrip() for line in text.splitlines())  # as piped: no padding


def test_format_option_reads_the_registry():
    command = typer.main.get_command(app).commands["check"]
    option = next(p for p in command.params if p.name == "format")
    assert formats.stream_names() == ("console", "github")
    assert option.metavar == "console|github"
    assert option.help == "console or github (::error annotations; default in GitHub Actions)."


def test_file_formats_name_settings_the_commands_take():
    fields = {f.name for f in dataclasses.fields(Settings)}
    params = {p.name for p in typer.main.get_command(app).commands["check"].params}
    for fmt in formats.FORMATS.values():
        assert fmt.name and fmt.suffix.startswith(".") and "format" in vars(type(fmt))
        assert set(fmt.paths) <= fields & params, fmt.name


def test_a_new_format_is_one_class_and_one_entry(monkeypatch, capsys, tmp_path):
    with pytest.raises(typer.Exit) as refused:
        validate.output_format(Settings(format="plain"))
    assert refused.value.exit_code == 2
    monkeypatch.setitem(formats.FORMATS, "plain", Plain())
    validate.output_format(Settings(format="plain"))  # accepted now
    assert "plain (one word per check)" in formats.format_help()
    junit = tmp_path / "r.xml"
    with pytest.raises(typer.Exit) as done:
        emit(REPORT, Settings(format="plain", junit=str(junit), quiet=True))
    assert done.value.exit_code == 1
    out = capsys.readouterr().out
    assert out.endswith("shuffle=fail\nrope=pass\n") and "FAIL shuffle" in out  # beside the console view
    assert junit.read_text() == format_junit(REPORT)


def test_github_goes_to_stderr_when_the_json_takes_stdout(capsys):
    with pytest.raises(typer.Exit):
        emit(REPORT, Settings(format="github", json="-", quiet=True))
    captured = capsys.readouterr()
    assert captured.out == format_json(REPORT)
    assert captured.err.endswith(format_github(REPORT)) and "::error" in captured.err


def test_groups_keep_each_command_signature_whole():
    """Every option a group gives a command reaches it: the command is called with one object per group."""
    from posdiag.cli.check import check

    params = inspect.signature(check).parameters
    assert {"max_memory", "seq_len", "json", "fail_on", "config", "only", "list_checks"} <= set(params)
    assert not {"load", "run", "output", "gate"} & set(params)


@pytest.mark.parametrize("command", ["check", "shuffle"])
def test_group_options_reach_the_settings(command, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.chdir(tmp_path)  # no config file found
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, [command, "some/model", "--show-config", "--max-memory", "0=1GiB",
                                      "--dtype", "float16", "--seq-len", "9", "--junit", "j.xml", "--fail-on", "warn"])
    assert result.exit_code == 0, result.output
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines() if "│" in line]
    rows = {c[0]: c[1:] for c in cells}
    for key, value in (("max-memory", "'0=1GiB'"), ("dtype", "'float16'"), ("seq-len", "9"), ("junit", "'j.xml'"),
                       ("fail-on", "'warn'")):
        assert rows[key] == [value, "command line"], (key, rows.get(key))
    assert rows["device"] == ["'auto'", "default"]


def test_github_is_the_default_inside_github_actions(monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert formats.default_stream() == "github"
    with pytest.raises(typer.Exit):
        emit(REPORT, Settings(quiet=True))
    assert capsys.readouterr().out.endswith(format_github(REPORT))
    monkeypatch.setenv("GITHUB_ACTIONS", "false")
    assert formats.default_stream() == "console"


def test_a_group_refuses_what_it_does_not_hold_and_a_twice_declared_option():
    from posdiag.cli.groups import Given, takes
    from posdiag.cli.options import LOAD, OUTPUT

    with pytest.raises(KeyError, match="no option nonsense"):
        LOAD.without("nonsense")
    with pytest.raises(KeyError, match="no option nonsense"):
        LOAD.but(nonsense=LOAD.options["dtype"])

    def command(json: str | None = None, *, output: Given) -> None: ...

    with pytest.raises(TypeError, match="declared twice"):
        takes(output=OUTPUT)(command)


def test_a_command_gets_one_object_per_group():
    from posdiag.cli.groups import Given, takes
    from posdiag.cli.options import LOAD, RUN

    seen = {}

    @takes(load=LOAD.only("dtype", "max_memory"), run=RUN.only("seed"))
    def command(model: str, *, load: Given, run: Given) -> None:
        seen.update(model=model, load=dict(load), seed=run.seed)

    assert list(inspect.signature(command).parameters) == ["model", "dtype", "max_memory", "seed"]
    command("m", dtype=LOAD.options["dtype"].default, max_memory="0=1GiB", seed=3)
    assert seen == {"model": "m", "load": {"dtype": "auto", "max_memory": "0=1GiB"}, "seed": 3}  # enums as values
