"""The `posdiag kernels` command (registered on the app defined in posdiag.cli).

`posdiag kernels MODEL`: the `kernels` check alone — eager vs sdpa (and FlashAttention where
installed on a GPU) on unpadded, left-padded and decode-with-cache inputs, per layer, against a
higher-precision eager reference. Half-precision models stay in their dtype here (--upcast to
compare in float32): kernels are compared at the precision they run in.

`posdiag kernels --synthetic`: no model. Random q, k, v of the given shape through each SDPA
backend that runs here, posdiag's naive attention in the run dtype and posdiag's tiled
online-softmax attention, against posdiag's float64 naive reference; `--sweep` doubles the
sequence length and shows peak memory (quadratic for naive, linear for tiled/flash).
Heavy imports happen inside the command.
"""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from posdiag.cli import (
    DebugOpt,
    Device,
    DeviceMapOpt,
    DeviceOpt,
    MaxMemoryOpt,
    OffloadOpt,
    DType,
    JsonOpt,
    PickleOpt,
    QuietOpt,
    RevisionOpt,
    SeedOpt,
    SeqLenOpt,
    TrustOpt,
    _emit,
    _fail,
    _guarded,
    _load,
    _run_options,
    app,
)

SyntheticOpt = Annotated[bool, typer.Option("--synthetic", help="No model: random q/k/v of the shape below.")]
ImplOpt = Annotated[Optional[str], typer.Option("--impl", help="Comma-separated implementations to compare with eager (default: sdpa, and flash_attention_2/3 where installed on a GPU).")]
KUpcastOpt = Annotated[bool, typer.Option("--upcast/--no-upcast", help="Compare a half-precision model in float32 (default: in its own dtype).")]
BatchOpt = Annotated[int, typer.Option("--batch", min=1, help="Synthetic: batch size.")]
HeadsOpt = Annotated[int, typer.Option("--heads", min=1, help="Synthetic: query heads.")]
KvHeadsOpt = Annotated[Optional[int], typer.Option("--kv-heads", min=1, help="Synthetic: key/value heads (GQA; default = --heads).")]
QLenOpt = Annotated[int, typer.Option("--q-len", min=1, help="Synthetic: query length.")]
KLenOpt = Annotated[Optional[int], typer.Option("--k-len", min=1, help="Synthetic: key length (default = --q-len).")]
HeadDimOpt = Annotated[int, typer.Option("--head-dim", min=1, help="Synthetic: head dimension.")]
CausalOpt = Annotated[bool, typer.Option("--causal/--no-causal", help="Synthetic: causal mask.")]
AlignOpt = Annotated[str, typer.Option("--alignment", help="Synthetic: causal alignment when q-len != k-len: bottom_right (KV-cache decode, FlashAttention >= 2.1) or top_left (SDPA is_causal).")]
PaddingOpt = Annotated[int, typer.Option("--padding", min=0, help="Synthetic: left-padded keys in the last row.")]
WindowOpt = Annotated[Optional[int], typer.Option("--window", min=1, help="Synthetic: sliding window (keys visible per query, itself included).")]
SweepOpt = Annotated[Optional[int], typer.Option("--sweep", min=2, help="Synthetic: double the length from --q-len up to this many tokens.")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, help="Synthetic: timed repetitions (median reported).")]
MemoryOpt = Annotated[bool, typer.Option("--memory/--no-memory", help="Synthetic: measure peak memory (CPU: via the torch profiler).")]
SDtypeOpt = Annotated[str, typer.Option("--dtype", help="Model: load dtype (auto = the checkpoint's). Synthetic: float32, bfloat16, float16 or float64.")]


@app.command()
def kernels(
    model: Annotated[Optional[str], typer.Argument(help="Hub id, local checkpoint directory, or module.path:factory (omit with --synthetic).", show_default=False)] = None,
    synthetic: SyntheticOpt = False, impl: ImplOpt = None,
    batch: BatchOpt = 2, heads: HeadsOpt = 8, kv_heads: KvHeadsOpt = None, q_len: QLenOpt = 256, k_len: KLenOpt = None,
    head_dim: HeadDimOpt = 64, causal: CausalOpt = True, alignment: AlignOpt = "bottom_right", padding: PaddingOpt = 0,
    window: WindowOpt = None, sweep: SweepOpt = None, repeats: RepeatsOpt = 3, memory: MemoryOpt = True,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: SDtypeOpt = "auto",
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadOpt = None, upcast: KUpcastOpt = False,
    allow_pickle: PickleOpt = False, seq_len: SeqLenOpt = None, seed: SeedOpt = 0, json: JsonOpt = None,
    quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Eager vs SDPA vs FlashAttention on MODEL, per layer; or --synthetic: kernels on random q/k/v."""
    if synthetic:
        if model:
            _fail("--synthetic takes no MODEL")
        _synthetic(locals())
        return
    if not model:
        _fail("no MODEL given (or pass --synthetic for random q/k/v)")
    if dtype not in [d.value for d in DType]:
        _fail(f"--dtype {dtype}: use one of {', '.join(d.value for d in DType)}")
    args = dict(locals())
    args["dtype"] = DType(dtype)
    _model(args)


def _model(args: dict) -> None:
    from rich.console import Console

    from posdiag.api import run_checks

    debug = args["debug"]
    settings = dict(args, attn_implementation="eager", max_batch=None, text=None, permutations=1)
    err = Console(stderr=True)
    with err.status(f"loading {args['model']}…"):
        subject = _guarded(lambda: _load(settings), debug)
    check_options = {}
    if args["impl"]:
        names = [n.strip() for n in args["impl"].split(",") if n.strip()]
        check_options = {"kernels": {"implementations": names}}
    options = _guarded(lambda: _run_options(settings, subject, check_options), debug)
    with err.status("comparing attention implementations…"):
        report = _guarded(lambda: run_checks(subject, ["kernels"], options), debug)
    _emit(report, settings, debug)


def _synthetic(args: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    debug = args["debug"]
    if args["alignment"] not in ("top_left", "bottom_right"):
        _fail(f"--alignment {args['alignment']}: use top_left or bottom_right")
    dtype = args["dtype"] if args["dtype"] != "auto" else "float32"
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        _fail(f"--dtype {dtype}: use float32, bfloat16, float16 or float64")
    kv = args["kv_heads"] or args["heads"]
    if args["heads"] % kv:
        _fail(f"--heads {args['heads']} is not a multiple of --kv-heads {kv}")

    from posdiag.tools.synthetic import Shape, judge_synthetic, sweep_lengths, synthetic
    from posdiag.model.loading import resolve_device

    device = _guarded(lambda: resolve_device(args["device"].value), debug)
    if device.type == "cpu" and dtype == "float16":
        pass  # CPU float16 runs (slowly); kept for completeness
    q_len = args["q_len"]
    k_len = args["k_len"] or q_len
    lengths = [(q_len, k_len)]
    if args["sweep"]:
        if args["sweep"] < q_len:
            _fail(f"--sweep {args['sweep']} is shorter than --q-len {q_len}")
        lengths = [(n, n) for n in sweep_lengths(q_len, args["sweep"])]
    out = Console(stderr=True) if args["json"] == "-" else Console()
    records = []
    any_fail = False
    for tq, tk in lengths:
        shape = Shape(batch=args["batch"], heads=args["heads"], kv_heads=kv, q_len=tq, k_len=tk,
                      head_dim=args["head_dim"], causal=args["causal"], alignment=args["alignment"],
                      padding=args["padding"], window=args["window"], dtype=dtype, device=str(device))
        results = _guarded(lambda: synthetic(shape, seed=args["seed"], memory=args["memory"], repeats=args["repeats"]), debug)
        verdicts = judge_synthetic(results, dtype)
        any_fail |= any(v.startswith("FAIL") for v in verdicts.values())
        records.append({"shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
                        "results": [dict(r.to_dict(), verdict=verdicts.get(r.name, "")) for r in results]})
        if args["quiet"]:
            for r in results:
                out.print(f"T={tq}/{tk} {r.name}: {r.status} err {r.error:.2e} {verdicts.get(r.name, '')}")
            continue
        title = (f"{device.type} {dtype}  B={shape.batch} H={shape.heads}/{kv} q={tq} k={tk} d={shape.head_dim}"
                 f"{' causal ' + shape.alignment if shape.causal else ''}"
                 f"{f' pad={shape.padding}' if shape.padding else ''}{f' window={shape.window}' if shape.window else ''}")
        table = Table(title=title, title_justify="left")
        for col in ("implementation", "error vs fp64", "max |Δ|", "time ms", "peak MiB", "empty rows", "verdict", "note"):
            table.add_column(col, justify="left" if col in ("implementation", "note", "verdict", "empty rows") else "right")
        for r in results:
            ok = r.status == "ok"
            table.add_row(r.name, f"{r.error:.2e}" if ok else "-", f"{r.max_abs:.1e}" if ok else "-",
                          f"{r.seconds * 1e3:.2f}" if ok else "-",
                          f"{r.peak_bytes / 2**20:.2f}" if ok and r.peak_bytes is not None else "-",
                          r.empty_rows or "-", verdicts.get(r.name, ""), r.note[:60])
        out.print(table)
    if args["sweep"] and args["memory"] and not args["quiet"]:
        _print_growth(out, records)
    out.print("rule: error <= 2 x posdiag naive's error in the same dtype + eps (FlashAttention's test rule)")
    if args["json"]:
        text = _json.dumps({"schema": 1, "synthetic": records}, indent=2, default=str)
        if args["json"] == "-":
            sys.stdout.write(text + "\n")
        else:
            _guarded(lambda: Path(args["json"]).write_text(text), debug)
    raise typer.Exit(1 if any_fail else 0)


def _print_growth(out, records: list[dict]) -> None:
    """Peak memory per implementation by length, and the growth exponent between the ends."""
    import math

    from rich.table import Table

    names = [r["name"] for r in records[0]["results"]]
    table = Table(title="peak memory (MiB) by sequence length; exponent p in memory ~ T^p", title_justify="left")
    table.add_column("implementation")
    for rec in records:
        table.add_column(str(rec["shape"]["q_len"]), justify="right")
    table.add_column("p", justify="right")
    for name in names:
        peaks = []
        for rec in records:
            r = next((x for x in rec["results"] if x["name"] == name), None)
            peaks.append(r["peak_bytes"] if r and r["status"] == "ok" else None)
        known = [(rec["shape"]["q_len"], p) for rec, p in zip(records, peaks) if p]
        slope = "-"
        if len(known) >= 2 and known[0][1] > 0:
            slope = f"{math.log(known[-1][1] / known[0][1]) / math.log(known[-1][0] / known[0][0]):.2f}"
        table.add_row(name, *[f"{p / 2**20:.2f}" if p else "-" for p in peaks], slope)
    out.print(table)
