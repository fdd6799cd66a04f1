"""Thin Typer app: parse, call the API, render, exit. No check logic lives here.

Heavy imports (torch, transformers) happen inside commands so `posdiag --help` is instant.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from posdiag import __version__

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


@app.command()
def shuffle(
    model: ModelArg,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seq_len: SeqLenOpt = None, seed: SeedOpt = 0,
    permutations: PermsOpt = 3, text: TextOpt = None, max_batch: MaxBatchOpt = None, json: JsonOpt = None,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Permutation test (the headline): do outputs merely permute when the tokens do?"""
    _run(locals(), ["shuffle"])


@app.command()
def check(
    model: ModelArg,
    only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated checks to run.")] = None,
    skip: Annotated[Optional[str], typer.Option("--skip", help="Comma-separated checks to leave out.")] = None,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seq_len: SeqLenOpt = None, seed: SeedOpt = 0,
    permutations: PermsOpt = 3, text: TextOpt = None, max_batch: MaxBatchOpt = None, json: JsonOpt = None,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Every applicable check: the CI gate."""
    from posdiag.api import select_checks

    args = locals()
    names = _guarded(lambda: select_checks(_split(only), _split(skip)), debug)
    _run(args, names)


def _split(value: Optional[str]) -> Optional[list[str]]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


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


def _run(args: dict, names: list[str]) -> None:
    from rich.console import Console

    debug = args["debug"]
    err = Console(stderr=True)
    with err.status(f"loading {args['model']}…"):
        subject = _guarded(lambda: _load(args), debug)
    options = _guarded(lambda: _run_options(args, subject), debug)

    from posdiag.api import run_checks
    from posdiag.report.console import render
    from posdiag.report.json_report import format_json

    with err.status("running checks…") as status:
        def progress(name: str) -> None:
            status.update(f"running {name}…")
        report = _guarded(lambda: run_checks(subject, names, options, on_progress=progress), debug)

    json_path = args["json"]
    out = Console(stderr=True) if json_path == "-" else Console()
    render(report, out, quiet=args["quiet"])
    if json_path:
        text = format_json(report)
        if json_path == "-":
            sys.stdout.write(text)
        else:
            _guarded(lambda: Path(json_path).write_text(text), debug)
    raise typer.Exit(report.exit_code)


def _load(args: dict):
    from posdiag.subject import LoadOptions, load_subject

    _quiet_transformers()

    options = LoadOptions(
        revision=args["revision"], trust_remote_code=args["trust_remote_code"], dtype=args["dtype"].value,
        device=args["device"].value, device_map=args["device_map"], attn_implementation=args["attn_implementation"],
        upcast=args["upcast"], allow_pickle=args["allow_pickle"], max_batch=args["max_batch"],
    )
    return load_subject(args["model"], options)


def _quiet_transformers() -> None:
    """transformers' own progress bars and missing-key warnings: posdiag reports those itself."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _run_options(args: dict, subject):
    from posdiag.errors import PosdiagError
    from posdiag.options import RunOptions, probe_length

    token_ids = None
    if args["text"]:
        token_ids = _tokenize(args["model"], args["text"], args["revision"], args["trust_remote_code"])
    options = RunOptions(seq_len=args["seq_len"], seed=args["seed"], permutations=args["permutations"], token_ids=token_ids)
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
from posdiag import cli_kernels, cli_rope  # noqa: E402,F401


if __name__ == "__main__":  # pragma: no cover
    app()
