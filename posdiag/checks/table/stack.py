"""Per stack: offsets first (which row each probe reads, whether ids are honoured), then capacity
over the declared context, then one position past it."""

from __future__ import annotations

from dataclasses import dataclass

from posdiag.checks.table.beyond import beyond
from posdiag.checks.table.capacity import capacity, long_row_limit
from posdiag.checks.table.discovery import PositionTable
from posdiag.checks.table.helpers import Part
from posdiag.checks.table.offsets import offset_parts
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import Status, Table


def stack_parts(subject: Subject, options: RunOptions, settings: dict, stack: str,
                tables: list[PositionTable], declared: int | None, out_tables: list[Table],
                own_offsets: dict[str, int], not_positions: dict[str, str]) -> list[Part]:
    where = f"{stack}_" if len(subject.stacks) > 1 else ""
    label = f"{stack}: " if len(subject.stacks) > 1 else ""
    token = int(subject.sample_ids(1, 1, options.seed)[0, 0])
    sizes = {f"table_rows_{t.name}": t.rows for t in tables}

    # 3. offsets first: they also tell whether position ids are really honoured and, for a family
    # posdiag has no row for, which row each probe reads.
    parts, honoured, found = offset_parts(subject, options, stack, tables, label, where)
    parts = list(parts)
    own_offsets.update(found["own"])
    not_positions.update(found["not_positions"])
    tables = [t for t in tables if t.name not in found["not_positions"]]  # indexed by another input
    offset = found["probe"]  # the row the capacity/beyond probes read for logical position 0
    span = _span(subject, settings, tables, declared, found["discovered"], offset, honoured, label, where, parts)
    if span is None:
        return parts

    # 1. capacity
    cap, outputs = capacity(subject, settings, stack, span.n, token, honoured, label, where)
    cap.metrics.update({"declared_positions": span.declared, "position_offset": offset, **sizes})
    parts.append(cap)
    if cap.details.get("table"):
        out_tables.append(cap.details.pop("table"))

    # 2. past the declared context
    if span.declared is not None and not span.static_short:
        declared = span.declared
        if span.limit is not None and declared + 1 > span.limit:
            parts.append(Part("beyond", Status.SKIP, f"{label}position {declared}: a row of {declared + 1} tokens "
                              f"is longer than max_long_row = {span.limit}", {"beyond_probed": False},
                              {"where": where}))
        else:
            parts.append(beyond(subject, stack, declared, token, honoured, tables, outputs, label, where, offset))
    return parts


@dataclass(frozen=True)
class _Span:
    """The positions the capacity and beyond probes cover."""

    declared: int | None  # the declared context (less RoBERTa-style offset rows)
    n: int  # positions the capacity probe reads
    static_short: bool  # the table has fewer rows than the declared context
    limit: int | None  # the longest row a model that derives positions itself is given


def _span(subject: Subject, settings: dict, tables: list[PositionTable], declared: int | None, discovered: bool,
          offset: int, honoured: bool, label: str, where: str, parts: list[Part]) -> _Span | None:
    """How many positions to probe, from the declared context and the table rows; the findings on the way (offset
    rows counted in the context, a table too short, rows too long to run) go into `parts`. None: nothing to size."""
    rows_cap = min((t.rows - offset for t in tables), default=None)
    if (discovered and rows_cap is not None and declared is not None and rows_cap < declared
            and min(t.rows for t in tables) >= declared):
        # RoBERTa's convention: max_position_embeddings counts the offset rows. Whatever the offset,
        # the table holds every row the model's own numbering can read; only rows_cap positions exist.
        parts.append(Part("offsets", Status.PASS, f"{label}the declared {declared} positions count the "
                          f"{offset} offset row(s), as RoBERTa's config does: {rows_cap} usable positions",
                          {"usable_positions": rows_cap}, {"where": where}))
        declared = rows_cap
    n = declared if declared is not None else rows_cap
    if n is None:
        parts.append(Part("capacity", Status.SKIP, f"{label}no declared context and no table rows to size the probe",
                          details={"where": where}))
        return None
    static_short = rows_cap is not None and declared is not None and rows_cap < declared
    if static_short:
        t = min(tables, key=lambda x: x.rows)
        parts.append(Part("capacity", Status.FAIL,
                          f"{label}table {t.name} has {t.rows} rows (first position at row {offset}): positions "
                          f"{rows_cap}..{declared - 1} of the declared {declared} have no row",
                          {"table_rows": t.rows, "declared_positions": declared},
                          {"where": where, "first_bad_position": rows_cap}))
        n = rows_cap
    # Without position ids, position p needs one row of p+1 tokens: the probe stops at the row length whose
    # attention (and explicit mask) still fits, and says which positions it left out.
    limit = None if honoured else long_row_limit(settings)
    if limit is not None and n > limit:
        parts.append(Part("capacity", Status.SKIP, f"{label}positions {limit}..{n - 1} of {n}: {subject.family.name} "
                          f"derives positions itself, so position p needs one row of p+1 tokens, and a row's attention "
                          f"and mask grow with its square (table setting max_long_row = {limit})",
                          {"long_row_limit": limit}, {"where": where}))
        n = limit
    return _Span(declared=declared, n=n, static_short=static_short, limit=limit)
