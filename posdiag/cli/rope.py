"""`posdiag rope MODEL`: RoPE analysis from the config alone (a config.json, a checkpoint directory
or a hub id; with --config-only no weights are read), then, unless --config-only, the `rope` check's
module probe on the loaded model, and optionally the copy probe. Heavy imports happen inside the command.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from posdiag.cli import validate
from posdiag.cli._flow import load_model, quiet_transformers, show_config, write_reports
from posdiag.cli._io import console_for, fail, guarded, loading, write_output
from posdiag.cli.groups import Given, takes
from posdiag.cli.options import CONFIG, LOAD, OUTPUT, RUN, ModelArg, Settings, resolve

TargetOpt = Annotated[int | None,
                      typer.Option("--target-length", min=1,
                                   help="Length you intend to run at (default: the declared context).")]
ConfigOnlyOpt = Annotated[bool, typer.Option("--config-only", help="Analyse the config alone; never read weights.")]
PlotOpt = Annotated[str | None,
                    typer.Option("--plot",
                                 help="Write a PNG (wavelength vs dim, probe error vs position) to PATH; needs "
                                      "matplotlib.")]
ProbeOpt = Annotated[str | None,
                     typer.Option("--probe", help="Extra behavioural probe to run: copy (copy accuracy by position).")]

PROBES = ("copy",)


@takes(load=LOAD.without("max_batch"), run=RUN.only("seed"), output=OUTPUT, config=CONFIG)
def rope(ctx: typer.Context, model: ModelArg, target_length: TargetOpt = None, config_only: ConfigOnlyOpt = False,
         plot: PlotOpt = None, probe: ProbeOpt = None, *, load: Given, run: Given, output: Given,
         config: Given) -> None:
    """RoPE analysis: frequencies vs training/target length from the config, then the module probe."""
    given = Settings(model=model, **load, **run, **output, **config)
    settings = guarded(lambda: replace(resolve(ctx, given), model=model), given.debug)
    if settings.show_config:
        show_config(settings)
        raise typer.Exit(0)
    json, quiet, debug = settings.json, settings.quiet, settings.debug
    validate.model_spec(model)
    validate.output_format(settings)
    validate.outputs(json=json, junit=settings.junit, html=settings.html, plot=plot)
    gguf = model.lower().endswith(".gguf") and Path(model).is_file()  # a MODEL, dequantised by transformers
    static_only = config_only or (Path(model).is_file() and not gguf)
    reports = [f"--{name}" for name in ("junit", "format", "html") if getattr(settings, name)]
    if static_only and reports:
        fail(f"{', '.join(reports)}: the report of the module probe; the config alone gives no verdict "
             "(drop --config-only, or pass a checkpoint)")
    if not static_only:
        validate.load_options(settings)
    copy_probe = _check_extras(probe, plot, static_only)

    from posdiag.model.loading import looks_like_factory
    from posdiag.report.json_report import format_rope_json
    from posdiag.report.plots import write_rope_png
    from posdiag.report.rope_console import quiet_line, render_rope_static
    from posdiag.tools import rope_math

    quiet_transformers()
    out = console_for(json, settings.junit)
    factory = looks_like_factory(model)
    if factory and config_only:
        fail("--config-only needs a config.json, a checkpoint directory or a hub id, not a module:factory")
    loaded = factory or (gguf and not config_only)
    subject = None
    if loaded:
        with loading(model):
            subject = guarded(lambda: load_model(settings), debug)
    config = subject.config if loaded else guarded(lambda: _read_config(settings), debug)
    specs = rope_math.rope_specs(config) if getattr(config, "model_type", "custom") != "custom" else []
    if not specs and static_only:
        fail(f"'{model}' describes no rotary position embedding (model type {getattr(config, 'model_type', '?')})")
    static = guarded(lambda: rope_math.analyze_config(config, target_length), debug) if specs else []

    if not quiet:
        render_rope_static(out, model, config, static)
    report = None if static_only else _run_probe(settings, subject, target_length, copy_probe, out)
    if plot:
        guarded(lambda: write_rope_png(plot, static, report), debug)
        out.print(f"wrote {plot}")
    if json:
        write_output(json, format_rope_json(model, static, report), debug)
    if report is not None:
        write_reports(report, settings, own=("json",))
    if report is None and quiet:
        for r in static:
            out.print(quiet_line(r))
    raise typer.Exit(report.exit_code if report is not None else 0)


def _check_extras(probe: str | None, plot: str | None, static_only: bool):
    """Refuse --probe/--plot requests that cannot run, before any loading; -> the copy probe module or None."""
    if probe is not None and probe not in PROBES:
        fail(f"--probe {probe}: unknown probe (known: {', '.join(PROBES)})")
    if probe and static_only:
        fail("--probe needs the model's weights; drop --config-only and pass a checkpoint or hub id")
    if plot:
        _require_matplotlib()
    return _import_copy_probe() if probe == "copy" else None


# --------------------------------------------------------------------------- inputs
def _read_config(settings: Settings):
    from transformers import AutoConfig

    from posdiag.errors import PosdiagError

    model = settings.model
    path = Path(model)
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise PosdiagError(f"'{model}' has no config.json: not a transformers checkpoint directory")
    elif model.startswith((".", "/", "~")) or model.count("/") > 1 or model.endswith(".json"):
        raise PosdiagError(f"'{model}' does not exist")
    try:
        if path.is_file() and model.lower().endswith(".gguf"):
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoConfig.from_pretrained(model, revision=settings.revision,
                                          trust_remote_code=settings.trust_remote_code)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "trust_remote_code" in first or "custom code" in first:
            raise PosdiagError(f"'{model}' needs its own Python code to load; rerun with --trust-remote-code if you "
                               "trust it") from None
        where = "read" if path.exists() else "fetch"
        raise PosdiagError(f"cannot {where} the config of '{model}': {first}") from None


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--plot needs matplotlib, which is not installed: pip install matplotlib (the terminal plots need "
             "nothing)")


def _import_copy_probe():
    import importlib

    try:
        copy_probe = importlib.import_module("posdiag.tools.copy_probe")
    except ImportError as exc:
        fail(f"--probe copy is not available in this installation ({exc})")
    if not callable(getattr(copy_probe, "run", None)):
        fail("--probe copy: posdiag.tools.copy_probe has no run(subject, lengths, seed)")
    return copy_probe


def copy_lengths(training_length: int, target_length: int | None = None) -> list[int]:
    """Lengths crossing the training length: L/2, L, 3L/2, 2L, 4L; with a target length N, those up to N and N/4,
    N/2, N (the question asked is about N: a probe at 4 x 8192 tokens on a model asked about 1024 was not asked)."""
    L = max(int(training_length), 8)
    lengths = {L // 2, L, (3 * L) // 2, 2 * L, 4 * L}
    if target_length:
        N = max(int(target_length), 8)
        lengths = {x for x in lengths if x <= N} | {N // 4, N // 2, N}
    return sorted(lengths)


# --------------------------------------------------------------------------- the probe
def _run_probe(settings: Settings, subject: Any, target_length: int | None, copy_probe, out):
    from rich.console import Console

    from posdiag.api import run_checks
    from posdiag.options import RunOptions
    from posdiag.report.console import render
    from posdiag.report.rope_console import error_plot
    from posdiag.tools import rope_math

    debug = settings.debug
    err = Console(stderr=True)
    if subject is None:
        with loading(settings.model):
            subject = guarded(lambda: load_model(settings), debug)
    options = RunOptions(seed=settings.seed,
                         check_options={"rope": {"target_length": target_length}} if target_length else {})
    with err.status("probing the rotation…"):
        report = guarded(lambda: run_checks(subject, ["rope"], options), debug)
    if copy_probe is not None:
        specs = rope_math.rope_specs(subject.config)
        train = min((s.training_length for s in specs if s.training_length), default=subject.max_positions or 64)
        lengths = copy_lengths(train, target_length)
        with err.status(f"copy probe at lengths {lengths}…"):
            result = guarded(lambda: copy_probe.run(subject, lengths, settings.seed), debug)
        report = replace(report, checks=report.checks + (result,))
    render(report, out, quiet=settings.quiet)
    if not settings.quiet:
        rows = report.check("rope").details.get("error_by_position") or []
        if rows:
            out.print(error_plot(rows))
    return report
