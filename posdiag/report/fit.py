"""Tables printed whole at any width and in any sink: a number or a verdict is never cut with `…`.

- Not a terminal (a pipe, a file, a CI log): the table is printed at the width it needs, whatever the
  console's width (rich would squeeze it into 80 columns and cut cells), its title on a line of its own when
  wider than the table; sink_console's consoles wrap no line and write no trailing spaces.
- A terminal too narrow for the table: short cells first (numbers in 3 significant digits, long reasons
  moved below the table as numbered notes), then rich's word wrapping if it cuts nothing, and as a last
  resort one line per row (`key: column value · column value ...`), which wraps between words only.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import re
import sys
from typing import TextIO

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

# A decimal or exponent number inside a cell ("1.567e-07", "0.4183", "100% / 5.71e-05").
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[+-]?\d+)?(?![\w.])|(?<![\w.])-?\d+e[+-]?\d+(?![\w.])")
PROSE = 24  # a text cell longer than this (with spaces) is a reason, printed below a narrow table


UNWRAPPED = 100_000  # a pipe's console width: no line is wrapped, a table takes the width it needs


class TrimmedLines(io.TextIOBase):
    """A text stream that writes each finished line without its trailing spaces (rich pads every table cell and
    title to its column's width: a piped `check` report had lines of ~390 columns, most of them spaces)."""

    def __init__(self, target: TextIO) -> None:
        self.target, self.pending = target, ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        if lines:
            self.target.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:  # a line without its newline yet stays pending: its padding may still come
        self.target.flush()


def sink_console(stderr: bool = False) -> Console:
    """The console for a report on stdout (stderr): a terminal's as rich makes it; anywhere else (a pipe, a file, a
    CI log) every line whole, never wrapped at COLUMNS or 80, without trailing spaces."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(file=TrimmedLines(sys.stderr if stderr else sys.stdout), width=UNWRAPPED)


def natural_width(console: Console, renderable: RenderableType) -> int:
    """The width the renderable takes when nothing limits it."""
    return Measurement.get(console, console.options.update_width(100_000), renderable).maximum


def print_table(console: Console, table: Table, *, prose: bool = False) -> None:
    """Print table whole. prose=True: a table whose text columns may wrap (the overview of checks)."""
    natural = natural_width(console, table)
    if not console.is_terminal:
        if table.title and len(str(table.title)) > natural:  # rich would wrap it at the table's width
            print_line(console, Text(str(table.title), style="italic"))
            table = copy.copy(table)
            table.title = None
        _print_at(console, table, max(console.width, natural))
        return
    if natural <= console.width or (prose and _whole(console, table, table)):
        console.print(table)
        return
    short = _short_numbers(table)
    if natural_width(console, short) <= console.width:
        console.print(short)
        return
    short, notes = _notes_below(short)
    if natural_width(console, short) <= console.width or _whole(console, short, table):
        console.print(short)
        for i, note in enumerate(notes, 1):
            console.print(Text(f"  [{i}] {note}"))
        return
    _print_rows(console, table)


def print_line(console: Console, line: Text) -> None:
    """One line of text: whole on one line outside a terminal, wrapped between words in one."""
    _print_at(console, line, console.width if console.is_terminal else max(console.width, len(line)))


def _print_at(console: Console, renderable: RenderableType, width: int) -> None:
    old = console.width
    if width == old:
        console.print(renderable)
        return
    console.width = width
    try:
        console.print(renderable)
    finally:
        console.width = old


def _cells(table: Table) -> list[list[RenderableType]]:
    return [list(c.cells) for c in table.columns]


def _plain(cell: RenderableType) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _with_cells(table: Table, columns: list[list[RenderableType]]) -> Table:
    new = copy.copy(table)
    new.columns = [dataclasses.replace(c, _cells=cells) for c, cells in zip(table.columns, columns, strict=True)]
    return new


def _short_numbers(table: Table) -> Table:
    def short(cell):
        if not isinstance(cell, str):
            return cell
        return NUMBER.sub(lambda m: f"{float(m.group()):.3g}", cell)

    return _with_cells(table, [[short(c) for c in col] for col in _cells(table)])


def _notes_below(table: Table) -> tuple[Table, list[str]]:
    """Long text cells (reasons) replaced by [n], the text listed below the table."""
    notes: list[str] = []
    columns = []
    for index, col in enumerate(_cells(table)):
        out = []
        for cell in col:
            text = _plain(cell)
            if index > 0 and isinstance(cell, str) and len(text) > PROSE and " " in text:
                notes.append(text)
                out.append(f"[{len(notes)}]")
            else:
                out.append(cell)
        columns.append(out)
    return _with_cells(table, columns), notes


def _whole(console: Console, table: Table, source: Table) -> bool:
    """Does rich's wrapping at this width keep every word (no `…` beyond those in the cells)?"""
    probe = Console(file=io.StringIO(), width=console.width, color_system=None, legacy_windows=False)
    probe.print(table)
    given = sum(_plain(c).count("…") for col in _cells(source) for c in col)
    given += sum(str(c.header).count("…") for c in source.columns) + str(source.title or "").count("…")
    return probe.file.getvalue().count("…") <= given


def _print_rows(console: Console, table: Table) -> None:
    """One line per row: the first column as the key, then `column value` pairs; a long row continues
    on indented lines, broken between pairs only."""
    if table.title:
        console.print(Text(str(table.title), style="italic"))
    headers = [str(c.header) for c in table.columns]
    columns = _cells(_short_numbers(table))
    for r in range(table.row_count):
        cells = [_plain(col[r]) for col in columns]
        pairs = [f"{h} {v}".strip() for h, v in zip(headers[1:], cells[1:], strict=True) if v.strip()]
        lines, line = [], f"  {cells[0]}:"
        for pair in pairs:
            if len(line) + 3 + len(pair) > console.width and line.strip():
                lines.append(line)
                line = "     "
            line += (" " if line.endswith(":") or not line.strip() else " · ") + pair
        lines.append(line)
        for text in lines:
            _print_at(console, Text(text), max(console.width, len(text)))
    if table.caption:
        console.print(Text(str(table.caption), style="dim"))
