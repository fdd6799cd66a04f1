"""Console rendering of `posdiag rope`: the static analysis of the rotary frequencies (before and after
scaling, per pair, a terminal wavelength plot), the applied-rotation error by position, and the
one-line quiet form. Data only comes from `tools.rope_math` results and the `rope` CheckResult."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from posdiag.report.fit import print_table


def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        return f"{v:.4g}"
    return str(v)


def render_rope_static(out: Console, model: str, config: Any, static: list) -> None:
    """Every rotary spec of the config: the before/after-scaling summary, pairs, wavelength plot, warnings."""
    if not static:
        return
    out.print(Text.assemble(("posdiag rope ", "bold"), (model, "bold cyan"),
                            f"  model type {getattr(config, 'model_type', '?')}"))
    for r in static:
        s = r.spec
        head = (f"{s.label}: {s.rope_type}, θ={s.theta:g}, rotary dims {s.rotary_dim}/{s.head_dim}"
                + (f", factor {s.factor:g}" if s.factor else "")
                + (f", original length {s.original_max}" if s.original_max else "")
                + (f", declared context {s.declared}" if s.declared else "")
                + (f", attention scaling {r.attention_scaling:.4g}" if r.attention_scaling != 1.0 else ""))
        out.print(Text(head, style="bold"))
        print_table(out, _side_by_side(r.before, r.after))
        print_table(out, _pair_table(r.after))
        if r.sections:
            print_table(out, _section_table(r.sections))
        out.print(Text("\n".join(wavelength_plot_lines(r.before, r.after))))
        for w in r.warnings:
            out.print(Text(f"  warning: {w}", style="yellow"))
        for n in r.notes:
            out.print(Text(f"  note: {n}", style="dim"))


def _side_by_side(b, a) -> Table:
    side = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("", "before scaling", "after scaling"):
        side.add_column(col, justify="left" if not col else "right")
    side.add_row("training length L", _fmt(b.training_length), _fmt(a.training_length))
    side.add_row("target length N", _fmt(b.target_length), _fmt(a.target_length))
    side.add_row("critical pair (first λ > L, 0-based)", f"{_fmt(b.critical_pair)} of {b.pairs}",
                 f"{_fmt(a.critical_pair)} of {a.pairs}")
    side.add_row("longest wavelength", _fmt(b.longest_wavelength), _fmt(a.longest_wavelength))
    side.add_row("pairs meeting unseen phases at N", _fmt(b.unseen_pairs), _fmt(a.unseen_pairs))
    side.add_row(f"alias (s(D) ≥ 1-{a.alias_epsilon:g}, far)",
                 _fmt(b.alias_offset) if b.alias_offset else f"none ≤ {b.alias_scanned}",
                 _fmt(a.alias_offset) if a.alias_offset else f"none ≤ {a.alias_scanned}")
    side.add_row("decay Σcos(Dθ) first zero (info)", _fmt(b.decay_first_zero), _fmt(a.decay_first_zero))
    return side


def _pair_table(a) -> Table:
    n = a.pairs
    picks = sorted(set(range(min(n, 4))) | {n - 1}
                   | ({a.critical_pair - 1, a.critical_pair} if a.critical_pair else set())
                   | set(range(0, n, max(1, n // 8))))
    picks = [p for p in picks if 0 <= p < n]
    t = Table(title=f"per pair ({len(picks)} of {n} shown)", title_justify="left", show_header=True,
              header_style="bold", box=None)
    for col in ("pair", "θ", "λ", "turns in L", "turns in N", "unseen at N"):
        t.add_column(col, justify="right")
    for p in picks:
        t.add_row(str(p), f"{a.freqs[p]:.4g}", _fmt(float(a.wavelengths[p])), f"{a.turns_training[p]:.3g}",
                  f"{a.turns_target[p]:.3g}", "yes" if a.unseen[p] else "")
    return t


def _section_table(sections) -> Table:
    t = Table(title=f"mRoPE sections ({sections[0].layout}): pairs per position stream", title_justify="left",
              show_header=True, header_style="bold", box=None)
    for col in ("stream", "pairs", "critical pair", "shortest λ", "longest λ", "unseen at N"):
        t.add_column(col, justify="right")
    for s in sections:
        shown = ", ".join(str(p) for p in s.pairs[:4]) + (", …" if len(s.pairs) > 4 else "")
        span = f"{s.pairs[0]}–{s.pairs[-1]}" if s.layout == "chunked" else shown
        t.add_row(s.stream, f"{len(s.pairs)}: {span}", _fmt(s.critical_pair), _fmt(s.shortest_wavelength),
                  _fmt(s.longest_wavelength), str(s.unseen_at_target))
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


def error_plot(rows: list, width: int = 48) -> Text:
    """Applied-rotation error (x tolerance) vs position, one bar per probed position (subsampled)."""
    step = max(1, len(rows) // 16)
    picked = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    top = max(max(r for _, _, r in picked), 10.0)
    lines = ["applied-rotation error vs position (x tolerance; FAIL above 10, log scale)"]
    for label, pos, ratio in picked:
        frac = math.log10(1 + ratio) / math.log10(1 + top)
        bar = "█" * max(0, int(round(frac * width)))
        lines.append(f"{label[:20]:>20} {pos:>9} │{bar} {ratio:.3g}")
    return Text("\n".join(lines))


def quiet_line(r) -> str:
    """One rotary spec in one line (--quiet without a model probe)."""
    a = r.after
    return (f"{r.spec.label}: {r.spec.rope_type} θ={r.spec.theta:g} critical pair {_fmt(a.critical_pair)} of "
            f"{a.pairs}, longest λ {_fmt(a.longest_wavelength)}, unseen pairs at {a.target_length}: {a.unseen_pairs}"
            + (f" — warning: {r.warnings[0]}" if r.warnings else ""))
