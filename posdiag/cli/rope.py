"""The `posdiag rope` command (registered on the app defined in posdiag.cli).

Static analysis from the config alone (a config.json, a checkpoint directory or a hub id; with
--config-only no weights are read), then, unless --config-only, the `rope` check's module probe
on the loaded model, and optionally the copy probe. Heavy imports happen inside the command.
"""

from __future__ import annotations

import json as _json
import math
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
        _render_static(out, model, config, static)

    report = None
    if not static_only:
        report = _run_probe(args, subject, target_length, copy_probe, out)

    if plot:
        _guarded(lambda: _write_png(plot, static, report), debug)
        out.print(f"wrote {plot}")
    if json:
        text = _json_text(model, static, report)
        if json == "-":
            sys.stdout.write(text)
        else:
            _guarded(lambda: Path(json).write_text(text), debug)
    if report is None and quiet:
        for r in static:
            _quiet_line(out, r)
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
            out.print(_error_plot(rows))
    return report


# --------------------------------------------------------------------------- rendering
def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        return f"{v:.4g}"
    return str(v)


def _render_static(out, model: str, config: Any, static: list) -> None:
    from rich.table import Table
    from rich.text import Text

    if not static:
        return
    out.print(Text.assemble(("posdiag rope ", "bold"), (model, "bold cyan"),
                            f"  model type {getattr(config, 'model_type', '?')}"))
    for r in static:
        s, b, a = r.spec, r.before, r.after
        head = (f"{s.label}: {s.rope_type}, θ={s.theta:g}, rotary dims {s.rotary_dim}/{s.head_dim}"
                + (f", factor {s.factor:g}" if s.factor else "")
                + (f", original length {s.original_max}" if s.original_max else "")
                + (f", declared context {s.declared}" if s.declared else "")
                + (f", attention scaling {r.attention_scaling:.4g}" if r.attention_scaling != 1.0 else ""))
        out.print(Text(head, style="bold"))
        side = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("", "before scaling", "after scaling"):
            side.add_column(col, justify="left" if not col else "right")
        side.add_row("training length L", _fmt(b.training_length), _fmt(a.training_length))
        side.add_row("target length N", _fmt(b.target_length), _fmt(a.target_length))
        side.add_row("critical pair (first λ > L, 0-based)", f"{_fmt(b.critical_pair)} of {b.pairs}", f"{_fmt(a.critical_pair)} of {a.pairs}")
        side.add_row("longest wavelength", _fmt(b.longest_wavelength), _fmt(a.longest_wavelength))
        side.add_row("pairs meeting unseen phases at N", _fmt(b.unseen_pairs), _fmt(a.unseen_pairs))
        side.add_row(f"alias (s(D) ≥ 1-{a.alias_epsilon:g}, far)",
                     _fmt(b.alias_offset) if b.alias_offset else f"none ≤ {b.alias_scanned}",
                     _fmt(a.alias_offset) if a.alias_offset else f"none ≤ {a.alias_scanned}")
        side.add_row("decay Σcos(Dθ) first zero (info)", _fmt(b.decay_first_zero), _fmt(a.decay_first_zero))
        out.print(side)
        out.print(_pair_table(a))
        out.print(_wavelength_plot(b, a))
        for w in r.warnings:
            out.print(Text(f"  warning: {w}", style="yellow"))
        for n in r.notes:
            out.print(Text(f"  note: {n}", style="dim"))


def _pair_table(a):
    from rich.table import Table

    n = a.pairs
    picks = sorted(set(range(min(n, 4))) | {n - 1} | ({a.critical_pair - 1, a.critical_pair} if a.critical_pair else set())
                   | set(range(0, n, max(1, n // 8))))
    picks = [p for p in picks if 0 <= p < n]
    t = Table(title=f"per pair ({len(picks)} of {n} shown)", title_justify="left", show_header=True, header_style="bold", box=None)
    for col in ("pair", "θ", "λ", "turns in L", "turns in N", "unseen at N"):
        t.add_column(col, justify="right")
    for p in picks:
        t.add_row(str(p), f"{a.freqs[p]:.4g}", _fmt(float(a.wavelengths[p])), f"{a.turns_training[p]:.3g}",
                  f"{a.turns_target[p]:.3g}", "yes" if a.unseen[p] else "")
    return t


def wavelength_plot_lines(before, after, height: int = 12, width: int = 64) -> list[str]:
    """A text plot: log10 wavelength (rows) vs pair (columns); ● after scaling (▲ where λ > L), · before, ─ L, ┄ N."""
    import numpy as np

    lam_a, lam_b = after.wavelengths, before.wavelengths
    finite = np.concatenate([lam_a[np.isfinite(lam_a)], lam_b[np.isfinite(lam_b)]])
    lo = math.log10(max(float(finite.min()), 1.0))
    hi = math.log10(max(float(finite.max()), after.target_length, after.training_length) * 1.01)
    n = after.pairs
    cols = min(width, n)
    grid = [[" "] * cols for _ in range(height)]

    def row(v: float) -> int:
        return int(round((math.log10(max(v, 1.0)) - lo) / max(hi - lo, 1e-9) * (height - 1)))

    for mark, value in (("┄", after.target_length), ("─", after.training_length)):
        r = row(value)
        for c in range(cols):
            grid[r][c] = mark
    for lam, after_set in ((lam_b, False), (lam_a, True)):
        for p in range(n):
            if np.isfinite(lam[p]):
                mark = ("▲" if lam[p] > after.training_length else "●") if after_set else "·"
                grid[row(float(lam[p]))][p * cols // n] = mark
    lines = []
    for r in range(height - 1, -1, -1):
        label = f"{10 ** (lo + (hi - lo) * r / max(height - 1, 1)):9.3g} │"
        tail = ""
        if r == row(after.training_length):
            tail = f" L={after.training_length}"
        if r == row(after.target_length) and after.target_length != after.training_length:
            tail += f" N={after.target_length}"
        lines.append(label + "".join(grid[r]) + tail)
    lines.append(" " * 10 + "└" + "─" * cols)
    lines.append(" " * 11 + f"pair 0 … {n - 1}   ● after scaling (▲ λ > L)  · before  ─ L  ┄ N  (λ, log scale)")
    return lines


def _wavelength_plot(before, after):
    from rich.text import Text

    return Text("\n".join(wavelength_plot_lines(before, after)))


def _error_plot(rows: list, width: int = 48):
    """Applied-rotation error (x tolerance) vs position, one bar per probed position (subsampled)."""
    from rich.text import Text

    step = max(1, len(rows) // 16)
    picked = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    top = max(max(r for _, _, r in picked), 10.0)
    lines = ["applied-rotation error vs position (x tolerance; FAIL above 10, log scale)"]
    for label, pos, ratio in picked:
        frac = math.log10(1 + ratio) / math.log10(1 + top)
        bar = "█" * max(0, int(round(frac * width)))
        lines.append(f"{label[:20]:>20} {pos:>9} │{bar} {ratio:.3g}")
    return Text("\n".join(lines))


def _quiet_line(out, r) -> None:
    a = r.after
    out.print(f"{r.spec.label}: {r.spec.rope_type} θ={r.spec.theta:g} critical pair {_fmt(a.critical_pair)} of {a.pairs}, "
              f"longest λ {_fmt(a.longest_wavelength)}, unseen pairs at {a.target_length}: {a.unseen_pairs}"
              + (f" — warning: {r.warnings[0]}" if r.warnings else ""))


# --------------------------------------------------------------------------- files
def _spec_json(r) -> dict:
    return {"layer_type": r.spec.layer_type, "rope_type": r.spec.rope_type, "theta": r.spec.theta,
            "head_dim": r.spec.head_dim, "rotary_dim": r.spec.rotary_dim, "params": r.spec.params,
            "attention_scaling": r.attention_scaling, "before": r.before.summary(), "after": r.after.summary(),
            "pairs": [{"pair": i, "freq": float(r.after.freqs[i]), "wavelength": float(r.after.wavelengths[i]),
                       "turns_training": float(r.after.turns_training[i]), "turns_target": float(r.after.turns_target[i]),
                       "unseen_at_target": bool(r.after.unseen[i])} for i in range(r.after.pairs)],
            "warnings": list(r.warnings), "notes": list(r.notes)}


def _json_text(model: str, static: list, report) -> str:
    from posdiag.results import jsonable

    if report is not None:
        data = report.to_dict()
    else:
        data = {"schema": 1, "model": {"id": model}, "checks": [], "exit_code": 0}
    data["rope"] = [_spec_json(r) for r in static]
    return _json.dumps(jsonable(data), indent=2) + "\n"


def _write_png(path: str, static: list, report) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.check("rope").details.get("error_by_position", []) if report is not None else []
    panels = 1 + bool(rows)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    for r in static:
        tag = f" ({r.spec.layer_type})" if r.spec.layer_type else ""
        ax.semilogy(r.before.wavelengths, ".", alpha=0.5, label=f"before scaling{tag}")
        ax.semilogy(r.after.wavelengths, "-", label=f"after scaling{tag}")
    if static:
        ax.axhline(static[0].after.training_length, color="k", ls="-", lw=0.8, label=f"L={static[0].after.training_length}")
        ax.axhline(static[0].after.target_length, color="r", ls="--", lw=0.8, label=f"N={static[0].after.target_length}")
    ax.set_xlabel("dim pair")
    ax.set_ylabel("wavelength (tokens)")
    ax.legend(fontsize=7)
    if rows:
        ax = axes[0][1]
        for label in dict.fromkeys(r[0] for r in rows):
            pts = [(p, v) for lab, p, v in rows if lab == label]
            ax.loglog([max(p, 1) for p, _ in pts], [max(v, 1e-3) for _, v in pts], "o-", label=label)
        ax.axhline(10, color="r", ls="--", lw=0.8, label="FAIL above")
        ax.set_xlabel("position")
        ax.set_ylabel("applied-rotation error / tolerance")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
