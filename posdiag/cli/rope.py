"""The `posdiag rope` command (registered on the app defined in posdiag.cli).

Static analysis from the config alone (a config.json, a checkpoint directory or a hub id; with
--config-only no weights are read), then, unless --config-only, the `rope` check's module probe
on the loaded model, and optionally the copy probe. Heavy imports happen inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from posdiag.cli import (
    AttnOpt,
    DebugOpt,
    DeviceMapOpt,
    DeviceOpt,
    MaxMemoryOpt,
    OffloadOpt,
    Device,
    DType,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    PickleOpt,
    QuietOpt,
    RevisionOpt,
    SeedOpt,
    TrustOpt,
    UpcastOpt,
    _fail,
    _guarded,
    _load,
    _quiet_transformers,
    app,
)

TargetOpt = Annotated[Optional[int], typer.Option("--target-length", min=1, help="Length you intend to run at (default: the declared context).")]
ConfigOnlyOpt = Annotated[bool, typer.Option("--config-only", help="Analyse the config alone; never read weights.")]
PlotOpt = Annotated[Optional[str], typer.Option("--plot", help="Write a PNG (wavelength vs dim, probe error vs position) to PATH; needs matplotlib (posdiag[plot]).")]
ProbeOpt = Annotated[Optional[str], typer.Option("--probe", help="Extra behavioural probe to run: copy (copy accuracy by position).")]

PROBES = ("copy",)


@app.command()
def rope(
    model: ModelArg,
    target_length: TargetOpt = None, config_only: ConfigOnlyOpt = False, plot: PlotOpt = None, probe: ProbeOpt = None,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seed: SeedOpt = 0, json: JsonOpt = None,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """RoPE analysis: frequencies vs training/target length from the config, then the module probe."""
    from rich.console import Console

    args = dict(locals())
    args["max_batch"] = None
    if probe is not None and probe not in PROBES:
        _fail(f"--probe {probe}: unknown probe (known: {', '.join(PROBES)})")
    static_only = config_only or Path(model).is_file()
    if probe and static_only:
        _fail("--probe needs the model's weights; drop --config-only and pass a checkpoint or hub id")
    if plot:
        _require_matplotlib()
    copy_probe = _import_copy_probe() if probe == "copy" else None

    from posdiag.tools import rope_math

    from posdiag.model.loading import looks_like_factory
    from posdiag.report.json_report import format_rope_json
    from posdiag.report.plots import write_rope_png
    from posdiag.report.rope_console import quiet_line, render_rope_static

    _quiet_transformers()
    out = Console(stderr=True) if json == "-" else Console()
    factory = looks_like_factory(model)
    if factory and config_only:
        _fail("--config-only needs a config.json, a checkpoint directory or a hub id, not a module:factory")
    subject = _guarded(lambda: _load(args), debug) if factory else None
    config = subject.config if factory else _guarded(lambda: _read_config(model, revision, trust_remote_code), debug)
    specs = rope_math.rope_specs(config) if getattr(config, "model_type", "custom") != "custom" else []
    if not specs and static_only:
        _fail(f"'{model}' describes no rotary position embedding (model type {getattr(config, 'model_type', '?')})")
    static = _guarded(lambda: rope_math.analyze_config(config, target_length), debug) if specs else []

    if not quiet:
        render_rope_static(out, model, config, static)

    report = None
    if not static_only:
        report = _run_probe(args, subject, target_length, copy_probe, out)

    if plot:
        _guarded(lambda: write_rope_png(plot, static, report), debug)
        out.print(f"wrote {plot}")
    if json:
        text = format_rope_json(model, static, report)
        if json == "-":
            sys.stdout.write(text)
        else:
            _guarded(lambda: Path(json).write_text(text), debug)
    if report is None and quiet:
        for r in static:
            out.print(quiet_line(r))
    raise typer.Exit(report.exit_code if report is not None else 0)


# --------------------------------------------------------------------------- inputs
def _read_config(model: str, revision: Optional[str], trust: bool):
    from transformers import AutoConfig

    from posdiag.errors import PosdiagError

    path = Path(model)
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise PosdiagError(f"'{model}' has no config.json: not a transformers checkpoint directory")
    elif model.startswith((".", "/", "~")) or model.count("/") > 1 or model.endswith(".json"):
        raise PosdiagError(f"'{model}' does not exist")
    try:
        return AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "trust_remote_code" in first or "custom code" in first:
            raise PosdiagError(f"'{model}' needs its own Python code to load; rerun with --trust-remote-code if you trust it") from None
        where = "read" if path.exists() else "fetch"
        raise PosdiagError(f"cannot {where} the config of '{model}': {first}") from None


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("--plot needs matplotlib, which is not installed: pip install 'posdiag[plot]' (the terminal plots need nothing)")


def _import_copy_probe():
    import importlib

    try:
        copy_probe = importlib.import_module("posdiag.tools.copy_probe")
    except ImportError as exc:
        _fail(f"--probe copy is not available in this installation ({exc})")
    if not callable(getattr(copy_probe, "run", None)):
        _fail("--probe copy: posdiag.tools.copy_probe has no run(subject, lengths, seed)")
    return copy_probe


def copy_lengths(training_length: int) -> list[int]:
    """Lengths crossing the training length: L/2, L, 3L/2, 2L, 4L."""
    L = max(int(training_length), 8)
    return sorted({L // 2, L, (3 * L) // 2, 2 * L, 4 * L})


# --------------------------------------------------------------------------- the probe
def _run_probe(args: dict, subject: Any, target_length: Optional[int], copy_probe, out):
    from dataclasses import replace

    from rich.console import Console

    from posdiag.tools import rope_math
    from posdiag.api import run_checks
    from posdiag.options import RunOptions
    from posdiag.report.console import render
    from posdiag.report.rope_console import error_plot

    debug = args["debug"]
    err = Console(stderr=True)
    if subject is None:
        with err.status(f"loading {args['model']}…"):
            subject = _guarded(lambda: _load(args), debug)
    options = RunOptions(seed=args["seed"], check_options={"rope": {"target_length": target_length}} if target_length else {})
    with err.status("probing the rotation…"):
        report = _guarded(lambda: run_checks(subject, ["rope"], options), debug)
    if copy_probe is not None:
        specs = rope_math.rope_specs(subject.config)
        train = min((s.training_length for s in specs if s.training_length), default=subject.max_positions or 64)
        lengths = copy_lengths(train)
        with err.status(f"copy probe at lengths {lengths}…"):
            result = _guarded(lambda: copy_probe.run(subject, lengths, args["seed"]), debug)
        report = replace(report, checks=report.checks + (result,))
    render(report, out, quiet=args["quiet"])
    if not args["quiet"]:
        rope_result = report.check("rope")
        rows = rope_result.details.get("error_by_position") or []
        if rows:
            out.print(error_plot(rows))
    return report
