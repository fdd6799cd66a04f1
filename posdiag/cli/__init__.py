"""Thin Typer app: parse, call the API, render, exit. No check logic lives here.

Heavy imports (torch, transformers) happen inside commands so `posdiag --help` is instant.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from posdiag._version import __version__

app = typer.Typer(
    name="posdiag",
    help="Find position-injection bugs in transformer checkpoints.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class DType(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


ModelArg = Annotated[str, typer.Argument(help="Hub id, local checkpoint directory, or module.path:factory.", show_default=False)]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the checkpoint's own Python code to run.")]
DtypeOpt = Annotated[DType, typer.Option("--dtype", help="Load dtype (auto = the checkpoint's).")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to run.")]
DeviceMapOpt = Annotated[Optional[str], typer.Option("--device-map", help="accelerate device map (e.g. auto) for models larger than one device.")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", help="With --device-map: memory per device, e.g. 0=70GiB,1=70GiB,cpu=200GiB; the rest goes to disk.")]
OffloadOpt = Annotated[Optional[str], typer.Option(
    "--offload-folder", help="With --device-map: where disk-offloaded weights go (default: a temporary folder, removed "
                             "after the run); never inside the checkpoint.")]
AttnOpt = Annotated[str, typer.Option("--attn-implementation", help="Attention implementation for the checks (eager honours custom masks).")]
UpcastOpt = Annotated[bool, typer.Option("--upcast/--no-upcast", help="Run equivariance checks in float32 when the model is half precision.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickle (.bin) weights, which can execute code.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", min=1, help="Probe length in tokens (default min(64, declared context)).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for probe tokens and permutations.")]
PermsOpt = Annotated[int, typer.Option("--permutations", min=1, max=64, help="Random permutations per equivariance test.")]
TextOpt = Annotated[Optional[str], typer.Option("--text", help="Probe with this text through the model's tokenizer instead of random ids.")]
MaxBatchOpt = Annotated[Optional[int], typer.Option("--max-batch", min=1, help="At most this many sequences per forward pass.")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", help="Write the JSON report to PATH ('-' for stdout).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="One line per check.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"posdiag {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
) -> None:
    """posdiag permutes, shifts and probes a model's inputs to tell whether position really entered it.

    Exit codes: 0 every check passed (warnings and skips allowed), 1 a check failed,
    2 usage or load error.
    """


OptionalModelArg = Annotated[Optional[str], typer.Argument(
    help="Hub id, local checkpoint directory, or module.path:factory (default: `model` in the config file).",
    show_default=False)]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="Config file (default: posdiag.toml or [tool.posdiag] in pyproject.toml).")]
ShowConfigOpt = Annotated[bool, typer.Option("--show-config", help="Print the effective configuration and exit.")]
JunitOpt = Annotated[Optional[str], typer.Option("--junit", help="Write a JUnit XML report to PATH.")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help="console or github (::error annotations; default in GitHub Actions).")]


@app.command()
def shuffle(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seq_len: SeqLenOpt = None, seed: SeedOpt = 0,
    permutations: PermsOpt = 3, text: TextOpt = None, max_batch: MaxBatchOpt = None, json: JsonOpt = None,
    junit: JunitOpt = None, format: FormatOpt = None, config: ConfigOpt = None, show_config: ShowConfigOpt = False,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Permutation test (the headline): do outputs merely permute when the tokens do?"""
    _run(ctx, locals(), fixed_checks=["shuffle"])


@app.command()
def check(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated checks to run.")] = None,
    skip: Annotated[Optional[str], typer.Option("--skip", help="Comma-separated checks to leave out.")] = None,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seq_len: SeqLenOpt = None, seed: SeedOpt = 0,
    permutations: PermsOpt = 3, text: TextOpt = None, max_batch: MaxBatchOpt = None, json: JsonOpt = None,
    junit: JunitOpt = None, format: FormatOpt = None, config: ConfigOpt = None, show_config: ShowConfigOpt = False,
    save_baseline: Annotated[Optional[str], typer.Option("--save-baseline", help="Also write the JSON report to PATH as a baseline.")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Fail when a metric regresses against this stored report.")] = None,
    baseline_margin: Annotated[float, typer.Option("--baseline-margin", min=1.0, help="Regression factor allowed against --baseline.")] = 10.0,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Every applicable check: the CI gate."""
    _run(ctx, locals())


def _split(value) -> Optional[list[str]]:
    if value is None or isinstance(value, list):
        return value
    return [v.strip() for v in value.split(",") if v.strip()]


def _guarded(fn, debug: bool):
    """Run fn; a PosdiagError (or any load-time crash) becomes one line on stderr and exit 2."""
    from posdiag.errors import PosdiagError

    try:
        return fn()
    except PosdiagError as exc:
        if debug:
            raise
        _fail(str(exc))
    except KeyboardInterrupt:
        typer.echo("posdiag: interrupted", err=True)
        raise typer.Exit(130)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _fail(f"{type(exc).__name__}: {first[:300]} (rerun with --debug for the traceback)")


def _fail(message: str) -> None:
    typer.echo(f"posdiag: error: {message}", err=True)
    raise typer.Exit(2)


def _value(x):
    return x.value if isinstance(x, enum.Enum) else x


def _effective(ctx: typer.Context, args: dict) -> tuple[dict, dict, dict]:
    """Command line > config file > defaults. Returns (settings, their sources, per-check options)."""
    from posdiag.config import find_config, merge, read_config

    def typed_by_user(name: str) -> bool:  # compare by name: typer may ship its own click
        return getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")

    typed = {k: v for k, v in args.items() if k != "ctx" and typed_by_user(k)}
    path = args.get("config") or find_config()
    file_values, check_options = read_config(Path(path)) if path else ({}, {})
    if args.get("config") and not Path(args["config"]).is_file():
        raise FileNotFoundError(args["config"])
    defaults = {k: v for k, v in args.items() if k != "ctx"}
    for key in ("only", "skip"):
        defaults.setdefault(key, None)
    effective, source = merge(defaults, {k: v for k, v in file_values.items() if k in defaults}, typed)
    effective = {k: _value(v) for k, v in effective.items()}
    for key in ("dtype", "device"):
        allowed = [m.value for m in (DType if key == "dtype" else Device)]
        if effective[key] not in allowed:
            from posdiag.errors import PosdiagError
            raise PosdiagError(f"{key} '{effective[key]}' from the config file is not one of {', '.join(allowed)}")
    effective["config_file"] = str(path) if path else None
    return effective, source, check_options


def _run(ctx: typer.Context, args: dict, fixed_checks: Optional[list[str]] = None) -> None:
    from rich.console import Console

    debug = args["debug"]
    settings, source, check_options = _guarded(lambda: _effective(ctx, args), debug)
    if settings.get("show_config"):
        _show_config(settings, source, check_options)
        raise typer.Exit(0)
    if not settings.get("model"):
        _fail("no MODEL given (pass one, or set `model` in [tool.posdiag] / posdiag.toml)")

    from posdiag.api import select_checks

    names = fixed_checks or _guarded(lambda: select_checks(_split(settings.get("only")), _split(settings.get("skip"))), debug)
    err = Console(stderr=True)
    with err.status(f"loading {settings['model']}…"):
        subject = _guarded(lambda: _load(settings), debug)
    try:
        options = _guarded(lambda: _run_options(settings, subject, check_options), debug)

        from posdiag.api import run_checks

        with err.status("running checks…") as status:
            def progress(name: str) -> None:
                status.update(f"running {name}…")
            report = _guarded(lambda: run_checks(subject, names, options, on_progress=progress), debug)
    finally:
        subject.close()  # the temporary offload folder of a --device-map run
    if settings.get("baseline"):
        report = _guarded(lambda: _with_baseline(report, settings["baseline"], settings["baseline_margin"]), debug)
    _emit(report, settings, debug)


def _with_baseline(report, path: str, margin: float):
    from dataclasses import replace

    from posdiag.baseline import compare, read_baseline

    return replace(report, checks=report.checks + (compare(report, read_baseline(path), margin),))


def _emit(report, settings: dict, debug: bool) -> None:
    """Render the report where the options say; the exit code is the report's."""
    import os

    from rich.console import Console

    from posdiag.report.console import render
    from posdiag.report.github import format_github
    from posdiag.report.json_report import format_json
    from posdiag.report.junit import format_junit

    json_path = settings.get("json")
    fmt = settings.get("format") or ("github" if os.environ.get("GITHUB_ACTIONS") == "true" else "console")
    if fmt not in ("console", "github"):
        _fail(f"--format {fmt}: use console or github")
    out = Console(stderr=True) if json_path == "-" else Console()
    render(report, out, quiet=settings.get("quiet", False))
    if fmt == "github":
        (sys.stderr if json_path == "-" else sys.stdout).write(format_github(report))
    writes = {json_path: format_json(report), settings.get("junit"): format_junit(report),
              settings.get("save_baseline"): format_json(report)}
    for path, text in writes.items():
        if not path:
            continue
        if path == "-":
            sys.stdout.write(text)
        else:
            _guarded(lambda: Path(path).write_text(text), debug)
    raise typer.Exit(report.exit_code)


def _show_config(settings: dict, source: dict, check_options: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"effective configuration (file: {settings.get('config_file') or 'none'})", title_justify="left")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("from")
    hidden = {"debug", "quiet", "show_config", "config", "config_file"}
    for key, value in settings.items():
        if key not in hidden:
            table.add_row(key.replace("_", "-"), repr(value), source.get(key, "default"))
    for name, opts in check_options.items():
        for key, value in opts.items():
            table.add_row(f"checks.{name}.{key}", repr(value), "config file")
    Console().print(table)


def _load(args: dict):
    """Load MODEL from command-line style settings (enums or plain strings)."""
    from posdiag.options import LoadOptions
    from posdiag.model.loading import load_subject

    _quiet_transformers()
    options = LoadOptions(
        revision=args.get("revision"), trust_remote_code=bool(args.get("trust_remote_code")),
        dtype=_value(args.get("dtype", "auto")), device=_value(args.get("device", "auto")),
        device_map=args.get("device_map"), max_memory=args.get("max_memory"), offload_folder=args.get("offload_folder"),
        attn_implementation=args.get("attn_implementation", "eager"),
        upcast=args.get("upcast", True), allow_pickle=bool(args.get("allow_pickle")), max_batch=args.get("max_batch"),
    )
    return load_subject(args["model"], options)


def _quiet_transformers() -> None:
    """transformers' own progress bars and missing-key warnings, accelerate's offload warning:
    posdiag reports those itself (the `load` check, the device-map note)."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)


def _run_options(args: dict, subject, check_options: Optional[dict] = None):
    from posdiag.errors import PosdiagError
    from posdiag.options import RunOptions, probe_length

    token_ids = None
    if args.get("text"):
        token_ids = _tokenize(args["model"], args["text"], args.get("revision"), bool(args.get("trust_remote_code")))
    options = RunOptions(seq_len=args.get("seq_len"), seed=args.get("seed", 0), permutations=args.get("permutations", 3),
                         token_ids=token_ids, check_options=dict(check_options or {}))
    probe_length(subject, options)  # validate the length against the declared context now, before any check
    if token_ids is not None and any(t >= subject.vocab_size for t in token_ids):
        raise PosdiagError("the tokenizer produced ids outside the model's vocabulary")
    return options


def _tokenize(model: str, text: str, revision, trust_remote_code: bool) -> tuple[int, ...]:
    from posdiag.errors import PosdiagError

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception:
        raise PosdiagError(f"--text needs a tokenizer, and none loads for '{model}' (drop --text to probe with random ids)") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 4:
        raise PosdiagError(f"--text gives {len(ids)} tokens; the probes need at least 4")
    return tuple(int(i) for i in ids)


# Commands that live in their own modules register themselves on `app` when imported.
from posdiag.cli import compare as cli_compare, kernels as cli_kernels, rope as cli_rope  # noqa: E402,F401
