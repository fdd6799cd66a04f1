"""What the command line accepts: the choices, the option types every command shares, and `Settings`,
the one typed object a run reads (command line > config file > defaults), with the one builder of
`LoadOptions` from it. No heavy imports here: `posdiag --help` reads this module."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from posdiag.cli.groups import Group, Opt
from posdiag.report.formats import format_help, stream_names

if TYPE_CHECKING:
    from posdiag.options import LoadOptions


class DType(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "fp32": "float32",
                 "f32": "float32", "float": "float32", "fp64": "float64", "f64": "float64", "double": "float64"}
"""The short names users type for a dtype (torch's own `half`, `float`, `double` among them)."""


def dtype_name(text: str) -> str | None:
    """A DType value for TEXT (the name itself or one of its aliases, any case); None when it names no dtype."""
    value = str(text).strip().lower()
    value = DTYPE_ALIASES.get(value, value)
    return value if value in {d.value for d in DType} else None


def dtype_choices() -> str:
    return f"{', '.join(d.value for d in DType)} (or {', '.join(DTYPE_ALIASES)})"


def parse_dtype(text: str) -> str:
    """--dtype's parser: the DType value, an alias accepted, anything else one line naming the choices."""
    value = dtype_name(text)
    if value is None:
        raise typer.BadParameter(f"'{text}' is no dtype: use {dtype_choices()}")
    return value


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="Hub id, local checkpoint directory, .gguf file, or module.path:factory.",
    show_default=False)]
OptionalModelArg = Annotated[str | None, typer.Argument(
    metavar="MODEL", help="Hub id, local checkpoint directory, .gguf file, or module.path:factory (default: `model` "
                          "in the config file).", show_default=False)]
RevisionOpt = Annotated[str | None,
                        typer.Option("--revision", metavar="REV", help="Hub revision (branch, tag or commit).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the checkpoint's own Python code to run.")]
DTYPE_METAVAR = "|".join(d.value for d in DType)
DtypeOpt = Annotated[str, typer.Option("--dtype", parser=parse_dtype, metavar=DTYPE_METAVAR,
                                       help="Load dtype (auto = the checkpoint's; bf16, fp16, fp32, fp64 also "
                                            "accepted).")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to run.")]
DeviceMapOpt = Annotated[str | None,
                         typer.Option("--device-map", metavar="MAP",
                                      help="accelerate device map (e.g. auto) for models larger than one device.")]
MaxMemoryOpt = Annotated[str | None, typer.Option(
    "--max-memory", metavar="BUDGET",
    help="With --device-map: memory per device, e.g. 0=70GiB,1=70GiB,cpu=200GiB; the rest goes to disk.")]
OffloadOpt = Annotated[str | None, typer.Option(
    "--offload-folder", metavar="DIR",
    help="With --device-map: where disk-offloaded weights go (default: a temporary folder, removed "
                             "after the run); never inside the checkpoint.")]
AttnOpt = Annotated[str,
                    typer.Option("--attn-implementation", metavar="IMPL",
                                 help="Attention implementation for the checks (eager honours custom masks).")]
UpcastOpt = Annotated[bool,
                      typer.Option("--upcast/--no-upcast",
                                   help="Judge a half-precision model in float32 instead of the dtype it runs "
                                        "in (default: as run; float64 re-runs decide either way).")]
PickleOpt = Annotated[bool,
                      typer.Option("--allow-pickle",
                                   help="Allow loading pickle (.bin) weights, which can execute code.")]
SeqLenOpt = Annotated[int | None,
                      typer.Option("--seq-len", metavar="N", min=1,
                                   help="Probe length in tokens (default min(64, declared context)).")]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="N", help="Seed for probe tokens and permutations.")]
PermsOpt = Annotated[int,
                     typer.Option("--permutations", metavar="N", min=1, max=64,
                                  help="Random permutations per equivariance test.")]
CompileOpt = Annotated[bool,
                       typer.Option("--compile/--no-compile",
                                    help="Judge generate()'s compiled path (torch.compile of the static-cache forward, "
                                         "once per shape); default: transformers' automatic compile off.")]
TextOpt = Annotated[str | None,
                    typer.Option("--text", metavar="TEXT",
                                 help="Probe with this text (or the text of this file) through the model's tokenizer "
                                      "instead of random ids; `fit` scores it in place of its own prose.")]
MaxBatchOpt = Annotated[int | None,
                        typer.Option("--max-batch", metavar="N", min=1,
                                     help="At most this many sequences per forward pass.")]
JsonOpt = Annotated[str | None,
                    typer.Option("--json", metavar="PATH", help="Write the JSON report to PATH ('-' for stdout).")]
JunitOpt = Annotated[str | None, typer.Option("--junit", metavar="PATH", help="Write a JUnit XML report to PATH.")]
HtmlOpt = Annotated[str | None, typer.Option(
    "--html", metavar="PATH", help="Write a self-contained HTML report to PATH (the verdicts, a plot of error against "
                                   "position per check, what each path confirmed).")]
FormatOpt = Annotated[str | None,
                      typer.Option("--format", metavar="|".join(stream_names()), help=format_help())]
ConfigOpt = Annotated[Path | None,
                      typer.Option("--config", metavar="PATH",
                                   help="Config file (default: posdiag.toml or [tool.posdiag] in pyproject.toml).")]
ShowConfigOpt = Annotated[bool, typer.Option("--show-config", help="Print the effective configuration and exit.")]
FailOnOpt = Annotated[str | None, typer.Option(
    "--fail-on", help="Also fail the gate (exit 1) on these statuses: warn, skip or warn,skip (a FAIL always fails).")]
RequireOpt = Annotated[str | None, typer.Option(
    "--require", help="Comma-separated checks that must PASS: one that warns, skips or does not run fails the gate.")]
SaveBaselineOpt = Annotated[str | None,
                            typer.Option("--save-baseline", metavar="PATH",
                                         help="Also write the JSON report to PATH as a baseline.")]
BaselineOpt = Annotated[str | None, typer.Option(
    "--baseline", metavar="PATH", help="Fail when a metric regresses against this stored report; a file that does not "
                                       "exist yet is written by a passing run (the first run of a CI gate).")]
BaselineRequiredOpt = Annotated[bool, typer.Option(
    "--baseline-required", help="A --baseline file that does not exist is a usage error (exit 2) instead of written.")]
MarginOpt = Annotated[float,
                      typer.Option("--baseline-margin", min=1.0, help="Regression factor allowed against --baseline.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="One line per check.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]

# The option groups every command takes (a part of, through cli.groups.takes); defaults are Settings' own.
LOAD = Group("load", {
    "revision": Opt(RevisionOpt), "trust_remote_code": Opt(TrustOpt, False), "dtype": Opt(DtypeOpt, "auto"),
    "device": Opt(DeviceOpt, Device.auto), "device_map": Opt(DeviceMapOpt), "max_memory": Opt(MaxMemoryOpt),
    "offload_folder": Opt(OffloadOpt), "attn_implementation": Opt(AttnOpt, "eager"), "upcast": Opt(UpcastOpt, False),
    "allow_pickle": Opt(PickleOpt, False), "max_batch": Opt(MaxBatchOpt),
})
RUN = Group("run", {
    "seq_len": Opt(SeqLenOpt), "seed": Opt(SeedOpt, 0), "permutations": Opt(PermsOpt, 3), "text": Opt(TextOpt),
    "compile": Opt(CompileOpt, False),
})
OUTPUT = Group("output", {
    "json": Opt(JsonOpt), "junit": Opt(JunitOpt), "html": Opt(HtmlOpt), "format": Opt(FormatOpt),
    "quiet": Opt(QuietOpt, False), "debug": Opt(DebugOpt, False),
})
GATE = Group("gate", {
    "fail_on": Opt(FailOnOpt), "require": Opt(RequireOpt), "save_baseline": Opt(SaveBaselineOpt),
    "baseline": Opt(BaselineOpt), "baseline_required": Opt(BaselineRequiredOpt, False),
    "baseline_margin": Opt(MarginOpt, 10.0),
})
CONFIG = Group("config", {"config": Opt(ConfigOpt), "show_config": Opt(ShowConfigOpt, False)})


@dataclass(frozen=True)
class Settings:
    """What one run was asked to do. Commands build it from their arguments; `resolve` lays a config
    file under the command line. Defaults are the command line's defaults."""

    model: str | None = None  # hub id, checkpoint directory or module.path:factory
    only: str | list[str] | None = None  # checks to run: comma-separated when typed, a list once resolved
    skip: str | list[str] | None = None  # checks to leave out, likewise
    # loading (load_options turns these into posdiag.options.LoadOptions, one to one)
    revision: str | None = None
    trust_remote_code: bool = False  # never execute checkpoint code unless asked
    dtype: str = "auto"  # a DType value; auto = the checkpoint's
    device: str = "auto"  # a Device value
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None
    attn_implementation: str = "eager"  # custom masks need eager
    upcast: bool = False
    allow_pickle: bool = False
    max_batch: int | None = None
    # probing (run_options turns these into posdiag.options.RunOptions)
    seq_len: int | None = None
    seed: int = 0
    permutations: int = 3
    text: str | None = None
    compile: bool = False
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per check: the config file's [checks.NAME]
    # the gate (api.gate_policy turns these into posdiag.results.GatePolicy)
    fail_on: str | list[str] | None = None  # warn and/or skip: comma-separated when typed, a list from a config file
    require: str | list[str] | None = None  # checks that must PASS, likewise
    # output
    json: str | None = None  # JSON report path, '-' for stdout
    junit: str | None = None
    html: str | None = None  # the HTML report's path
    format: str | None = None  # a stream format of report.formats; None = github inside GitHub Actions
    save_baseline: str | None = None
    baseline: str | None = None  # a missing file is written by a passing run, unless baseline_required
    baseline_required: bool = False
    baseline_margin: float = 10.0
    quiet: bool = False
    debug: bool = False
    # the configuration itself
    config: Path | None = None  # --config as typed
    show_config: bool = False
    config_file: str | None = None  # the file read (typed or found), None when there is none
    # the command's settings, in its order -> where each came from
    sources: dict[str, str] = field(default_factory=dict)


_NAMES = frozenset(f.name for f in fields(Settings))


def resolve(ctx: typer.Context, given: Settings) -> Settings:
    """Command line > config file > defaults, for the settings the command takes (and --only/--skip,
    which a config file may set for any command). Raises PosdiagError for a bad config file."""
    from posdiag.config import find_config, merge, read_config
    from posdiag.errors import PosdiagError

    def typed_by_user(name: str) -> bool:  # compare by name: typer may ship its own click
        return getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")

    names = [p.name for p in ctx.command.params if p.name in _NAMES]
    names += [n for n in ("only", "skip") if n not in names]
    values = {name: getattr(given, name) for name in names}
    typed = {name: value for name, value in values.items() if typed_by_user(name)}
    path = given.config or find_config()
    file_values, check_options = read_config(Path(path)) if path else ({}, {})
    if check_options:
        from posdiag.checks import validate_tables

        validate_tables(check_options, str(path))
    if given.config and not Path(given.config).is_file():
        raise FileNotFoundError(given.config)
    effective, source = merge(values, {k: v for k, v in file_values.items() if k in values}, typed)
    for key in ("only", "skip"):  # one shape whichever way it came: a list of names
        if isinstance(effective.get(key), str):
            effective[key] = [v.strip() for v in effective[key].split(",") if v.strip()]
    if "dtype" in effective:
        if dtype_name(effective["dtype"]) is None:
            raise PosdiagError(f"dtype '{effective['dtype']}' from the config file is no dtype: use {dtype_choices()}")
        effective["dtype"] = dtype_name(effective["dtype"])
    if "device" in effective and effective["device"] not in (allowed := [m.value for m in Device]):
        raise PosdiagError(f"device '{effective['device']}' from the config file is not one of {', '.join(allowed)}")
    return replace(given, **effective, check_options=check_options, config_file=str(path) if path else None,
                   sources=source)


def load_options(settings: Settings) -> LoadOptions:
    """The one place the CLI turns settings into posdiag.options.LoadOptions."""
    from posdiag.options import LoadOptions

    return LoadOptions(
        revision=settings.revision, trust_remote_code=bool(settings.trust_remote_code), dtype=settings.dtype,
        device=settings.device, device_map=settings.device_map, max_memory=settings.max_memory,
        offload_folder=settings.offload_folder, attn_implementation=settings.attn_implementation,
        upcast=settings.upcast, allow_pickle=bool(settings.allow_pickle), max_batch=settings.max_batch,
    )
