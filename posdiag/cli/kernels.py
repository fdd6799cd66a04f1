"""`posdiag kernels MODEL`: the `kernels` check alone — eager vs each SDPA backend, pinned (and
FlashAttention where installed on a GPU) on unpadded, left-padded and decode-with-cache inputs, per layer, against a
higher-precision eager reference. Half-precision models stay in their dtype here (--upcast to
compare in float32): kernels are compared at the precision they run in.

`posdiag kernels --synthetic`: no model. Random q, k, v of the given shape through each SDPA
backend that runs here, posdiag's naive attention in the run dtype and posdiag's tiled
online-softmax attention, against posdiag's float64 naive reference; `--sweep` doubles the
sequence length (up to --sweep-to) and shows peak memory (quadratic for naive, linear for tiled/flash).
Heavy imports happen inside the command.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, NoReturn

import typer

from posdiag.cli import validate
from posdiag.cli._flow import emit, load_model, run_options, show_config
from posdiag.cli._io import console_for, fail, guarded, loading, without_profiler_noise, write_output
from posdiag.cli.groups import Given, Group, Opt, takes
from posdiag.cli.options import CONFIG, LOAD, OUTPUT, RUN, Settings, parse_dtype, resolve

SyntheticOpt = Annotated[bool, typer.Option("--synthetic", help="No model: random q/k/v of the shape below.")]
ImplOpt = Annotated[str | None,
                    typer.Option("--impl",
                                 help="Comma-separated implementations to compare with eager (default: each SDPA "
                                      "backend pinned, sdpa[flash] sdpa[math] on CPU, also sdpa[efficient] "
                                      "sdpa[cudnn] and flex_attention on CUDA, flash_attention_2/3 where installed; "
                                      "plain sdpa lets torch choose).")]
KUpcastOpt = Annotated[bool,
                       typer.Option("--upcast/--no-upcast",
                                    help="Compare a half-precision model in float32 (default: in its own dtype).")]
BatchOpt = Annotated[int, typer.Option("--batch", min=1, help="Synthetic: batch size.")]
HeadsOpt = Annotated[int, typer.Option("--heads", min=1, help="Synthetic: query heads.")]
KvHeadsOpt = Annotated[int | None,
                       typer.Option("--kv-heads", min=1, help="Synthetic: key/value heads (GQA; default = --heads).")]
QLenOpt = Annotated[int, typer.Option("--q-len", min=1, help="Synthetic: query length.")]
KLenOpt = Annotated[int | None, typer.Option("--k-len", min=1, help="Synthetic: key length (default = --q-len).")]
HeadDimOpt = Annotated[int, typer.Option("--head-dim", min=1, help="Synthetic: head dimension.")]
CausalOpt = Annotated[bool, typer.Option("--causal/--no-causal", help="Synthetic: causal mask.")]
AlignOpt = Annotated[str,
                     typer.Option("--alignment",
                                  help="Synthetic: causal alignment when q-len != k-len: bottom_right (KV-cache "
                                       "decode, FlashAttention >= 2.1) or top_left (SDPA is_causal).")]
PaddingOpt = Annotated[int, typer.Option("--padding", min=0, help="Synthetic: left-padded keys in the last row.")]
WindowOpt = Annotated[int | None,
                      typer.Option("--window", min=1,
                                   help="Synthetic: sliding window (keys visible per query, itself included).")]
SweepOpt = Annotated[bool,
                     typer.Option("--sweep",
                                  help="Synthetic: double the length from --q-len up to --sweep-to and show peak "
                                       "memory by length.")]
SweepToOpt = Annotated[int | None,
                       typer.Option("--sweep-to", metavar="N", min=2,
                                    help="Synthetic: the longest length of --sweep (implies it; default 8 x --q-len).")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, help="Synthetic: timed repetitions (median reported).")]
MemoryOpt = Annotated[bool,
                      typer.Option("--memory/--no-memory",
                                   help="Synthetic: measure peak memory (CPU: via the torch profiler).")]
SDtypeOpt = Annotated[str,
                      typer.Option("--dtype", parser=parse_dtype,
                                   help="Model: load dtype (auto = the checkpoint's). Synthetic: float32, bfloat16, "
                                        "float16 or float64.")]
KernelsModelArg = Annotated[str | None, typer.Argument(
    metavar="MODEL", help="Hub id, local checkpoint directory, .gguf file, or module.path:factory (omit with "
                          "--synthetic).", show_default=False)]

SHAPE = Group("shape", {  # kernels --synthetic only
    "batch": Opt(BatchOpt, 2), "heads": Opt(HeadsOpt, 8), "kv_heads": Opt(KvHeadsOpt), "q_len": Opt(QLenOpt, 256),
    "k_len": Opt(KLenOpt), "head_dim": Opt(HeadDimOpt, 64), "causal": Opt(CausalOpt, True),
    "alignment": Opt(AlignOpt, "bottom_right"), "padding": Opt(PaddingOpt, 0), "window": Opt(WindowOpt),
    "sweep": Opt(SweepOpt, False), "sweep_to": Opt(SweepToOpt), "repeats": Opt(RepeatsOpt, 3),
    "memory": Opt(MemoryOpt, True),
})
# the kernels check compares implementations against eager, each at the precision it runs in
KERNELS_LOAD = LOAD.without("attn_implementation", "max_batch").but(dtype=Opt(SDtypeOpt, "auto"),
                                                                     upcast=Opt(KUpcastOpt, False))


@takes(shape=SHAPE, load=KERNELS_LOAD, run=RUN.only("seq_len", "seed"), output=OUTPUT, config=CONFIG)
def kernels(ctx: typer.Context, model: KernelsModelArg = None, synthetic: SyntheticOpt = False, impl: ImplOpt = None,
            *, shape: Given, load: Given, run: Given, output: Given, config: Given) -> None:
    """Eager vs SDPA vs FlashAttention on MODEL, per layer; or --synthetic: kernels on random q/k/v."""
    given = Settings(model=model, **load, **run, **output, **config)
    settings = guarded(lambda: resolve(ctx, given), given.debug)
    if settings.show_config:
        show_config(settings)
        raise typer.Exit(0)
    if synthetic:
        if model:
            fail("--synthetic takes no MODEL")
        reports = [f"--{name}" for name in ("junit", "format", "html") if getattr(settings, name)]
        if reports:
            fail(f"{', '.join(reports)}: for a run on a model (a report of checks); --synthetic writes --json")
        _synthetic(SyntheticRun.of(shape, settings))
    if not settings.model:
        fail("no MODEL given (or pass --synthetic for random q/k/v)")
    validate.model_spec(settings.model)
    validate.output_format(settings)
    validate.outputs(json=settings.json, junit=settings.junit, html=settings.html)
    validate.load_options(settings)
    # the kernels check alone, eager as the baseline, one pass per input
    settings = replace(settings, attn_implementation="eager", permutations=1)
    if impl:
        settings = replace(settings, check_options={"kernels": {"implementations": _implementations(impl)}})
    _model(settings)


def _implementations(impl: str) -> list[str]:
    """--impl's names, each one transformers knows (a typo is one line, exit 2, before the model loads)."""
    from posdiag.checks.kernels.scenarios import unknown_implementation

    names = [n.strip() for n in impl.split(",") if n.strip()]
    for name in names:
        why = unknown_implementation(name)
        if why:
            fail(f"--impl {name}: {why}")
    if not names:
        fail("--impl names no implementation")
    return names


def _model(settings: Settings) -> None:
    from rich.console import Console

    from posdiag.api import run_checks

    debug = settings.debug
    err = Console(stderr=True)
    with loading(settings.model):
        subject = guarded(lambda: load_model(settings), debug)
    options = guarded(lambda: run_options(settings, subject), debug)
    with err.status("comparing attention implementations…"):
        report = guarded(lambda: run_checks(subject, ["kernels"], options), debug)
    emit(report, settings)


@dataclass(frozen=True)
class SyntheticRun:
    """What `kernels --synthetic` was asked: the shape of the random q/k/v, the lengths, how to measure."""

    batch: int
    heads: int
    kv_heads: int | None  # None = heads
    q_len: int
    k_len: int | None  # None = q_len
    head_dim: int
    causal: bool
    alignment: str  # top_left | bottom_right
    padding: int
    window: int | None
    sweep: int | None  # double the length from q_len up to this
    repeats: int
    memory: bool
    dtype: str  # auto = float32
    device: str  # a Device value
    seed: int
    json: str | None
    quiet: bool
    debug: bool

    @classmethod
    def of(cls, shape: Given, settings: Settings) -> SyntheticRun:
        """From the command's shape group and settings: --sweep-to implies --sweep (default 8 x --q-len)."""
        sweep = (shape.sweep_to or 8 * shape.q_len) if (shape.sweep or shape.sweep_to) else None
        given = {k: v for k, v in shape.items() if k not in ("sweep", "sweep_to")}
        return cls(**given, sweep=sweep, dtype=settings.dtype, device=settings.device, seed=settings.seed,
                   json=settings.json, quiet=settings.quiet, debug=settings.debug)


def _synthetic(run: SyntheticRun) -> NoReturn:
    debug = run.debug
    if run.alignment not in ("top_left", "bottom_right"):
        fail(f"--alignment {run.alignment}: use top_left or bottom_right")
    dtype = run.dtype if run.dtype != "auto" else "float32"
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        fail(f"--dtype {dtype}: use float32, bfloat16, float16 or float64")
    kv = run.kv_heads or run.heads
    if run.heads % kv:
        fail(f"--heads {run.heads} is not a multiple of --kv-heads {kv}")

    from posdiag.model.loading import resolve_device
    from posdiag.report.json_report import format_synthetic_json
    from posdiag.report.synthetic_console import RULE, render_growth, render_synthetic
    from posdiag.tools.synthetic import Shape, judge_synthetic, sweep_lengths, synthetic

    device = guarded(lambda: resolve_device(run.device), debug)  # CPU float16 runs (slowly); kept for completeness
    lengths = [(run.q_len, run.k_len or run.q_len)]
    if run.sweep:
        if run.sweep < run.q_len:
            fail(f"--sweep-to {run.sweep} is shorter than --q-len {run.q_len}")
        lengths = [(n, n) for n in sweep_lengths(run.q_len, run.sweep)]
    out = console_for(run.json)
    records = []
    any_fail = False
    for tq, tk in lengths:
        shape = Shape(batch=run.batch, heads=run.heads, kv_heads=kv, q_len=tq, k_len=tk, head_dim=run.head_dim,
                      causal=run.causal, alignment=run.alignment, padding=run.padding, window=run.window,
                      dtype=dtype, device=str(device))
        with without_profiler_noise():
            results = guarded(lambda shape=shape: synthetic(shape, seed=run.seed, memory=run.memory,
                                                            repeats=run.repeats), debug)
        verdicts = judge_synthetic(results, dtype)
        any_fail |= any(v.startswith("FAIL") for v in verdicts.values())
        records.append({"shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
                        "results": [dict(r.to_dict(), verdict=verdicts.get(r.name, "")) for r in results]})
        render_synthetic(out, shape, results, verdicts, quiet=run.quiet)
    if run.sweep and run.memory and not run.quiet:
        render_growth(out, records)
    out.print(RULE)
    if run.json:
        write_output(run.json, format_synthetic_json(records), debug)
    raise typer.Exit(1 if any_fail else 0)
