"""generate() runs without transformers' automatic compile unless --compile asks for the compiled path.

transformers compiles the static-cache forward by itself on accelerators (94 s of a 1B model's generate on an
H200, 22 s without): posdiag decides instead, and the result says which path it judged. Here the suite checks what
is handed to generate(); tests/test_generate_compiled_run.py runs the compiled path itself on a one-layer Llama."""

from dataclasses import replace
from pathlib import Path

from posdiag.api import run_checks
from posdiag.model.caches import compile_kwargs
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo


def test_compile_keywords():
    assert compile_kwargs(False) == {"disable_compile": True}
    config = compile_kwargs(True)["compile_config"]
    assert config._compile_all_devices is True  # compiles on CPU too, on purpose


def test_generate_hands_its_choice_to_generate_and_reports_it(monkeypatch):
    seen = []

    model = zoo.tiny_model("llama")
    original = model.generate

    def spy(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("cache_implementation", "disable_compile", "compile_config")})
        kwargs.pop("compile_config", None)  # the compiled path itself is not run here (a minute on CPU)
        return original(*args, **{**kwargs, "disable_compile": True})

    monkeypatch.setattr(model, "generate", spy)
    subject = from_module(model)
    default = run_checks(subject, ["generate"]).check("generate")
    assert default.status is Status.PASS and default.details["compiled"] is False
    assert seen and all(s["disable_compile"] is True and s["compile_config"] is None for s in seen)
    seen.clear()
    asked = run_checks(subject, ["generate"], replace(RunOptions(), compile=True)).check("generate")
    # the spy kept every call eager: the report says so, read from the run, instead of echoing the option
    # (tests/test_generate_compiled_run.py compiles for real)
    assert asked.details["compile_asked"] is True and asked.details["compiled"] is False
    assert "--compile asked, but no forward call ran compiled" in asked.summary
    static = [s for s in seen if s["cache_implementation"] == "static"]
    assert static and all(s["compile_config"] is not None and not s["disable_compile"] for s in static)
    assert all(s["disable_compile"] for s in seen if s not in static)  # a dynamic cache is never compiled


def test_compile_from_the_command_line_and_the_config_file(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from posdiag.cli import app

    runner = CliRunner()
    model = str(Path(__file__).parent.parent / "fixtures" / "llama-tiny")
    monkeypatch.chdir(tmp_path)
    row = lambda out: next(line for line in out.splitlines() if "│ compile" in line)  # noqa: E731
    assert "False" in row(runner.invoke(app, ["check", model, "--show-config"]).output)
    assert "True" in row(runner.invoke(app, ["check", model, "--compile", "--show-config"]).output)
    (tmp_path / "posdiag.toml").write_text("compile = true\n")
    assert "True" in row(runner.invoke(app, ["check", model, "--show-config"]).output)
    assert "--compile" not in runner.invoke(app, ["shuffle", "--help"]).output  # only generate reads it
