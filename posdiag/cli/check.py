"""`posdiag shuffle` and `posdiag check`: resolve the settings (command line > config file >
defaults), load MODEL, run the checks, compare with a baseline, emit the report."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer

from posdiag.cli import validate
from posdiag.cli._flow import emit, load_model, run_options, show_config
from posdiag.cli._io import fail, guarded, loading
from posdiag.cli.groups import Given, takes
from posdiag.cli.options import CONFIG, GATE, LOAD, OUTPUT, RUN, OptionalModelArg, Settings, resolve

T = TypeVar("T")

OnlyOpt = Annotated[str | None, typer.Option("--only", metavar="NAMES", help="Comma-separated checks to run.")]
SkipOpt = Annotated[str | None, typer.Option("--skip", metavar="NAMES", help="Comma-separated checks to leave out.")]
ListOpt = Annotated[bool, typer.Option("--list", help="List every check (name, title, what a PASS proves) and exit.")]


@takes(load=LOAD, run=RUN.without("compile"), output=OUTPUT, gate=GATE.only("fail_on"), config=CONFIG)
def shuffle(ctx: typer.Context, model: OptionalModelArg = None, *, load: Given, run: Given, output: Given,
            gate: Given, config: Given) -> None:
    """Permutation test (the headline): do outputs merely permute when the tokens do?"""
    given = Settings(model=model, **load, **run, **output, **gate, **config)
    run_command(ctx, given, fixed_checks=["shuffle"])


@takes(load=LOAD, run=RUN, output=OUTPUT, gate=GATE, config=CONFIG)
def check(ctx: typer.Context, model: OptionalModelArg = None, only: OnlyOpt = None, skip: SkipOpt = None,
          list_checks: ListOpt = False, *, load: Given, run: Given, output: Given, gate: Given,
          config: Given) -> None:
    """Every applicable check: the CI gate."""
    if list_checks:
        _list_checks()
        raise typer.Exit(0)
    given = Settings(model=model, only=only, skip=skip, **load, **run, **output, **gate, **config)
    run_command(ctx, given)


def run_command(ctx: typer.Context, given: Settings, fixed_checks: list[str] | None = None) -> NoReturn:
    """Resolve the settings, then show them, or validate every option, load MODEL, run the checks and
    emit the report."""
    from rich.console import Console

    debug = given.debug
    settings = guarded(lambda: resolve(ctx, given), debug)
    if settings.show_config:
        show_config(settings)
        raise typer.Exit(0)
    if not settings.model:
        fail("no MODEL given (pass one, or set `model` in [tool.posdiag] / posdiag.toml)")
    validate.model_spec(settings.model)
    validate.output_format(settings)
    validate.outputs(json=settings.json, junit=settings.junit, html=settings.html,
                     save_baseline=settings.save_baseline)
    validate.load_options(settings)
    stored = validate.baseline(settings)

    from posdiag.api import gate_policy, run_checks, select_checks

    names = fixed_checks or guarded(lambda: select_checks(settings.only, settings.skip), debug)
    if not names:
        fail(f"no check left to run (--only {','.join(settings.only or [])} --skip {','.join(settings.skip or [])})")
    policy = guarded(lambda: gate_policy(settings.fail_on, settings.require), debug)
    err = Console(stderr=True)
    with loading(settings.model):
        subject = guarded(lambda: _junit_if_aborted(settings, lambda: load_model(settings)), debug)
    try:
        options = guarded(lambda: _junit_if_aborted(settings, lambda: run_options(settings, subject)), debug)
        # Where stderr is no terminal (a CI log), the spinner shows nothing: one plain line per finished check instead.
        finished = None if settings.quiet or err.is_terminal else _finished_line
        with err.status("running checks…") as status:
            progress = _Progress(names, status.update)
            report = guarded(lambda: run_checks(subject, names, options, on_progress=progress, policy=policy,
                                                on_result=finished), debug)
    finally:
        subject.close()  # the temporary offload folder of a --device-map run
    first_baseline = None
    if settings.baseline and not report.incomplete:
        if stored is not None:
            report = guarded(lambda: _with_baseline(report, stored, settings.baseline_margin), debug)
        else:
            report, first_baseline = _first_baseline(report, settings.baseline)
    emit(report, settings, baseline=first_baseline)


class _Progress:
    """The status line while checks run: which check of how many, and the time since the first one started
    ("check 5/11 cache · 12.3 s"). The status spinner re-renders it several times a second, so the clock moves."""

    def __init__(self, names: list[str], update: Callable[[object], None]) -> None:
        self.total, self.update, self.index, self.name, self.start = len(names), update, 0, "", None

    def __call__(self, name: str) -> None:
        import time

        self.start = self.start or time.perf_counter()
        self.index, self.name = self.index + 1, name
        self.update(self)

    def __rich__(self) -> str:
        import time

        return f"check {self.index}/{self.total} {self.name} · {time.perf_counter() - self.start:.1f} s"


def _finished_line(result) -> None:
    """`posdiag: cache FAIL (4.8 s)`: a long run's log says where it is."""
    import sys

    print(f"posdiag: {result.name} {result.status.value.upper()} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)


def _list_checks() -> None:
    """One entry per registered check, from its spec: name and title, what a PASS proves, where it applies,
    the `[checks.NAME]` settings it takes with their defaults."""
    from posdiag import checks

    width = max(len(name) for name in checks.REGISTRY)
    for name in checks.REGISTRY:
        spec = checks.spec(name)
        if spec is None:
            typer.echo(f"{name:<{width}}  (not implemented in this version of posdiag)")
            continue
        pad = " " * (width + 2)
        typer.echo(f"{name:<{width}}  {spec.title}")
        typer.echo(f"{pad}proves: {spec.proves}")
        if set(spec.applies_to) != set(checks.KINDS):
            typer.echo(f"{pad}applies to: {', '.join(spec.applies_to)} models")
        if spec.options:
            settings = ", ".join(f"{key} = {option.default!r}" for key, option in spec.options.items())
            typer.echo(f"{pad}[checks.{name}]: {settings}")


def _junit_if_aborted(settings: Settings, step: Callable[[], T]) -> T:
    """A load or option error ends the run before any check: the JUnit file asked for is still written
    (one `load` testcase with the error), so the CI job has a report to upload; the error then goes on."""
    try:
        return step()
    except Exception as exc:
        if settings.junit and settings.junit != "-":
            from posdiag.errors import one_line
            from posdiag.report.junit import format_junit_aborted

            with contextlib.suppress(OSError):
                Path(settings.junit).write_text(format_junit_aborted(settings.model, one_line(exc)))
        raise


def _with_baseline(report, stored: dict, margin: float):
    from posdiag.baseline import compare

    return replace(report, checks=report.checks + (compare(report, stored, margin),))


def _first_baseline(report, path: str):
    """No baseline yet: a passing run writes this report there (and says so); a failing one does not."""
    from posdiag.baseline import first_run

    ok = report.exit_code == 0
    stored = report
    report = replace(report, checks=report.checks + (first_run(path, written=ok),))
    return report, ((path, stored) if ok else None)
