"""A curves.Plot drawn as inline SVG, written here (no plotting library, nothing fetched): log error axis (an exact
zero drawn at the bottom edge), each series a line with points, the floor and the tolerance as labelled dashed
lines, the first failing position as a red vertical line with its label. Every text is escaped."""

from __future__ import annotations

import math
from html import escape

from posdiag.report.curves import Level, Plot

WIDTH, HEIGHT = 760, 300
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 30, 46
PALETTE = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
LEVEL_STYLE = {"floor": ("#777777", "2 3"), "tolerance": ("#e08a00", "6 4"), "fail": ("#d62728", "6 4")}
FAILING = "#d62728"
LEGEND_COLUMNS = 2


def render_svg(plot: Plot) -> str:
    """The plot as one <svg> element (with a legend below it)."""
    ys = [y for s in plot.series for _, y in s.points] + [y for lv in plot.levels for y in _level_ys(lv)]
    positive = [y for y in ys if y > 0]
    low = min(positive, default=1e-8) / 10
    high = max(positive, default=1.0) * 2
    y_lo, y_hi = math.floor(math.log10(low)), math.ceil(math.log10(high))
    xs = [x for s in plot.series for x, _ in s.points] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    legend = _legend_entries(plot)
    rows = math.ceil(len(legend) / LEGEND_COLUMNS)
    height = HEIGHT + 18 * rows
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        if plot.log_x and x_lo > 0:
            return LEFT + inner_w * math.log10(x / x_lo) / max(math.log10(x_hi / x_lo), 1e-9)
        return LEFT + inner_w * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        exp = math.log10(max(y, 10.0 ** y_lo))
        return TOP + inner_h * (1 - (exp - y_lo) / max(y_hi - y_lo, 1))

    out = [f'<svg class="plot" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(plot.title)}">',
           f'<title>{escape(plot.title)}</title>',
           f'<rect x="{LEFT}" y="{TOP}" width="{inner_w}" height="{inner_h}" fill="#fff" stroke="#999"/>',
           f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" class="title">{escape(plot.title)}</text>']
    out += _axes(plot, px, py, x_lo, x_hi, y_lo, y_hi, inner_h)
    out += _drawn(plot, px, py, inner_w, inner_h)
    out += _legend(legend, HEIGHT)
    out.append("</svg>")
    return "\n".join(out)


def _drawn(plot: Plot, px, py, inner_w: float, inner_h: float) -> list[str]:
    """The levels (dashed), the series (lines with points) and the first failing position (a red vertical)."""
    out = []
    for level in plot.levels:
        color, dash = LEVEL_STYLE.get(level.kind, LEVEL_STYLE["floor"])
        if level.y is not None:
            y = py(level.y)
            out.append(f'<line class="level {escape(level.kind)}" x1="{LEFT}" x2="{LEFT + inner_w}" y1="{y:.1f}" '
                       f'y2="{y:.1f}" stroke="{color}" stroke-dasharray="{dash}"><title>{escape(level.label)}</title>'
                       '</line>')
        elif level.points:
            pts = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in level.points)
            out.append(f'<polyline class="level {escape(level.kind)}" points="{pts}" fill="none" stroke="{color}" '
                       f'stroke-dasharray="{dash}"><title>{escape(level.label)}</title></polyline>')
    for i, series in enumerate(plot.series):
        color = PALETTE[i % len(PALETTE)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in series.points)
        out.append(f'<g class="series{" failing" if series.failing else ""}" data-label="{escape(series.label)}">'
                   f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{color}"><title>'
                f'{escape(series.label)}: {x:g} → {y:.3g}</title></circle>' for x, y in series.points]
        out.append("</g>")
    if plot.first_failing is not None:
        x, what = plot.first_failing
        at = px(x)
        out.append(f'<g class="first-failing" data-x="{x:g}"><line x1="{at:.1f}" x2="{at:.1f}" y1="{TOP}" '
                   f'y2="{TOP + inner_h}" stroke="{FAILING}" stroke-width="2"/>'
                   f'<text x="{min(at + 4, WIDTH - RIGHT - 4):.1f}" y="{TOP + 12}" fill="{FAILING}" '
                   f'text-anchor="{"start" if at < WIDTH * 0.7 else "end"}">first failing: {x:g} '
                   f'({escape(what)})</text></g>')
    return out


def _level_ys(level: Level) -> list[float]:
    return [level.y] if level.y is not None else [v for _, v in level.points]


def _axes(plot: Plot, px, py, x_lo: float, x_hi: float, y_lo: int, y_hi: int, inner_h: float) -> list[str]:
    out = []
    step = max(1, math.ceil((y_hi - y_lo) / 6))
    for e in range(y_lo, y_hi + 1, step):
        y = py(10.0 ** e)
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">1e{e}</text>')
    for x in _x_ticks(x_lo, x_hi, plot.log_x):
        at = px(x)
        out.append(f'<text x="{at:.1f}" y="{TOP + inner_h + 16}" text-anchor="middle" class="tick">{x:g}</text>')
    out.append(f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2}" y="{TOP + inner_h + 34}" text-anchor="middle" '
               f'class="axis">{escape(_short(plot.x_label, 110))}</text>')
    out.append(f'<text x="14" y="{TOP + inner_h / 2}" text-anchor="middle" class="axis" '
               f'transform="rotate(-90 14 {TOP + inner_h / 2})">{escape(plot.y_label)} (log; 0 at the bottom)</text>')
    return out


def _x_ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log and lo > 0:
        ticks, x = [], 2.0 ** math.floor(math.log2(lo))
        while x <= hi:
            if x >= lo:
                ticks.append(x)
            x *= 2
        return ticks
    raw = (hi - lo) / 6
    mag = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _legend_entries(plot: Plot) -> list[tuple[str, str, str, str]]:
    """(label, color, dash, class) per series and level."""
    entries = [(s.label + (" (failing)" if s.failing else ""), PALETTE[i % len(PALETTE)], "", "series")
               for i, s in enumerate(plot.series)]
    for lv in plot.levels:
        color, dash = LEVEL_STYLE.get(lv.kind, LEVEL_STYLE["floor"])
        entries.append((lv.label, color, dash, lv.kind))
    if plot.first_failing is not None:
        entries.append((f"first failing position ({plot.first_failing[0]:g})", FAILING, "", "first-failing"))
    return entries


def _legend(entries: list[tuple[str, str, str, str]], top: float) -> list[str]:
    out = []
    col_w = (WIDTH - LEFT) / LEGEND_COLUMNS
    for i, (label, color, dash, kind) in enumerate(entries):
        x, y = LEFT + (i % LEGEND_COLUMNS) * col_w, top + 4 + 18 * (i // LEGEND_COLUMNS)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<g class="legend key-{escape(kind)}"><line x1="{x:.1f}" x2="{x + 22:.1f}" y1="{y:.1f}" '
                   f'y2="{y:.1f}" stroke="{color}" stroke-width="2"{dashes}/><text x="{x + 28:.1f}" y="{y + 4:.1f}" '
                   f'class="legend">{escape(_short(label, 54))}</text></g>')
    return out
