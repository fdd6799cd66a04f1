"""Offsets: which row the model's own computation reads for logical position 1 (a marker added to row
`position_offset + 1` must move position 1 and nothing else; for a family with no measured offset
the row is discovered), and, where position ids are taken, omitted ids vs ids passed by the family
convention (+`explicit_position_offset`)."""

from __future__ import annotations

from typing import Any

import torch

from posdiag.checks.table.discovery import PositionTable
from posdiag.checks.table.helpers import Part, rel
from posdiag.errors import raised_in_posdiag
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.verdict import MACHINE_EPSILON, band_tolerance, judge_agreement, judge_position_signal

OFFSET_LEN = 16          # tokens of the offset / marker probes
DISCOVER_ROWS = 1024     # rows searched for the first one read, for a family with no measured offset


def offset_parts(subject: Subject, options: RunOptions, stack: str, tables: list[PositionTable],
                 label: str, where: str) -> tuple[list[Part], bool, dict[str, Any]]:
    """Markers (which row the model's own numbering reads at position 1), then omitted vs passed ids.

    Returns the parts, whether ids are honoured, and the offsets: "own" (table -> row read at
    position 0 without ids), "probe" (row read at logical position 0 by the capacity/beyond probes)
    and "discovered" (the family has no measured row: the offsets were found, not assumed)."""
    fam = subject.family
    ids = subject.sample_ids(1, OFFSET_LEN, options.seed + 1)[0]
    enc = ids[None] if subject.kind == "seq2seq" and stack == "decoder" else None
    default = subject.forward(ids[None], stack=stack, encoder_ids=enc).hidden[0][0]
    parts: list[Part] = []
    own: dict[str, int] = {}
    for t in tables:
        part, row0 = (_marker(subject, stack, t, ids, enc, default, label, where) if fam.offsets_known
                      else _discover(subject, stack, t, ids, enc, default, label, where))
        parts.append(part)
        if row0 is not None:
            own[t.name] = row0
    parts, others = _other_inputs(parts, tables, own, label, where)
    discovered = not fam.offsets_known and bool(own)
    own_offset = next(iter(own.values()), fam.position_offset) if discovered else fam.position_offset
    found: dict[str, Any] = {"own": own, "probe": own_offset, "discovered": discovered, "not_positions": others}
    if not fam.takes_position_ids:
        return parts, False, found
    part, honoured, shift = _passed_ids(subject, stack, ids, enc, default, discovered, own_offset, label, where)
    if shift is not None:
        found["probe"] = own_offset - shift
    return parts + [part], honoured, found


def _other_inputs(parts: list[Part], tables: list[PositionTable], own: dict[str, int], label: str,
                  where: str) -> tuple[list[Part], dict[str, str]]:
    """Tables named like position tables but indexed by another input, once another table of the stack is read
    in position order: one whose rows no text forward reads (LUKE's entity position table, read through
    entity_position_ids), or whose one row every token reads (LayoutLM's x/y/h/w tables, indexed by the layout
    box, all zeros by default). Their parts become SKIPs that say so; -> (parts, {table: why}). A stack whose only
    table is read so keeps the FAIL: positions then reach no table at all."""
    if not own:
        return parts, {}
    ordered = ", ".join(n for n in own)
    others: dict[str, str] = {}
    out = []
    for t, part in zip(tables, parts, strict=True):
        reads = part.details.get("reads")
        if t.name in own or reads not in ("none", "one row"):
            out.append(part)
            continue
        how = ("no row of it is read by a forward of tokens alone" if reads == "none" else
               f"every token reads its row {part.metrics.get('shared_row')}, whatever its position")
        why = f"not a table of token positions: {how} (indexed by another input), while {ordered} is read in order"
        others[t.name] = why
        out.append(Part("offsets", Status.SKIP, f"{label}{t.name}: {why}", part.metrics,
                        {"where": where, "not_positions": why}))
    return out, others


def _passed_ids(subject: Subject, stack: str, ids, enc, default, discovered: bool, own_offset: int, label: str,
                where: str) -> tuple[Part, bool, int | None]:
    """Omitted ids vs ids passed by the family convention. -> (the part, whether passed ids are honoured,
    the shift of passed ids that reproduces the model's own numbering when the offsets were discovered)."""
    fam = subject.family
    dtype = subject.dtype_name
    shifts = [s for s in (-2, -1, 0, 1, 2) if s >= -fam.position_offset - fam.explicit_position_offset]
    if discovered:  # passed id x reads row x + k; k is 0 or OPT's 2 in practice: shift own-k matches
        shifts = sorted(set(shifts) | {s for s in (own_offset, own_offset - 1, own_offset - 2) if s > 2})
    try:
        out = _shifted(subject, stack, ids, enc, shifts)
    except Exception as exc:  # the model refuses a negative shift below the table's first row (a wrong offset)
        if raised_in_posdiag(exc):
            raise
        shifts = [0, 1, 2]
        out = _shifted(subject, stack, ids, enc, shifts)
    err = {s: rel(out.hidden[0][i], default) for i, s in enumerate(shifts)}
    agree = judge_agreement(err[0], 0.0, dtype)
    moved = judge_position_signal(err[1], 0.0, dtype)  # a shift must move far above rounding
    metrics = {"offset_error": err[0], "offset_shift_effect": err[1]}
    match = [s for s in shifts if s != 0 and judge_agreement(err[s], 0.0, dtype).status is Status.PASS]
    if moved.status is not Status.PASS:
        return Part("offsets", Status.SKIP,
                    f"{label}shifting the passed position ids by 1 changes the embeddings by only "
                    f"{err[1]:.2g}: ids not honoured (or no position signal); omitted-vs-passed not judged",
                    metrics, {"where": where}), False, None
    if agree.status is Status.PASS:
        return Part("offsets", Status.PASS, f"{label}ids omitted == ids passed as logical+"
                    f"{fam.explicit_position_offset} (error {err[0]:.2g})", metrics, {"where": where}), True, None
    if discovered and match:
        # No convention to judge against: which ids reproduce the model's own numbering is information.
        return Part("offsets", Status.PASS, f"{label}the model's own positions are ids passed as "
                    f"logical{match[0]:+d} (error {err[match[0]]:.2g}; posdiag passes logical+0: "
                    f"{fam.name} has no row in posdiag's family table)", {**metrics, "matching_shift": match[0]},
                    {"where": where, "matching_shift": match[0]}), True, match[0]
    said = (f"the model's own positions are the convention shifted by {match[0]:+d}" if match
            else "no small shift explains it")
    status = Status.FAIL if fam.offsets_known else Status.WARN  # no convention known: inconclusive
    return Part("offsets", status, f"{label}ids omitted != ids passed as logical+"
                f"{fam.explicit_position_offset} (error {err[0]:.2g} = {agree.ratio:.3g}x floor): {said}",
                metrics, {"where": where, "matching_shift": match[0] if match else None}), True, None


def _shifted(subject: Subject, stack: str, ids, enc, shifts: list[int]):
    rows = [Row(ids, positions=torch.arange(len(ids)) + s) for s in shifts]
    return run_rows(subject, rows, stack=stack, explicit_mask=False,
                    encoder_ids=None if enc is None else enc.expand(len(rows), -1))


def _moved(subject: Subject, stack: str, t: PositionTable, rows: list[int], ids, enc, default) -> list[int]:
    """Positions of the default forward that move when a distinct random marker is added to each of `rows`."""
    gen = torch.Generator().manual_seed(1234)
    with subject.stored_weight(t.name) as table:  # offloaded: an in-memory copy the next forward reads
        scale = max(float(table.detach().abs().max()), 1.0)
        index = torch.tensor(rows, device=table.device)
        marker = (torch.randn(len(rows), t.dim, generator=gen) * scale).to(table.dtype).to(table.device)
        saved = table.detach()[index].clone()
        try:
            with torch.no_grad():
                table[index] += marker
            moved = subject.forward(ids[None], stack=stack, encoder_ids=enc).hidden[0][0]
        finally:
            with torch.no_grad():
                table[index] = saved
    change = (moved - default).double().norm(dim=-1) / max(float(default.double().norm(dim=-1).median()), 1e-30)
    line = band_tolerance(MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7))
    return [int(i) for i in torch.nonzero(change > line).flatten()]


def _marker(subject: Subject, stack: str, t: PositionTable, ids, enc, default, label: str,
            where: str) -> tuple[Part, int | None]:
    """Add a marker to row position_offset+1 and see which position of the default forward moves."""
    fam = subject.family
    row = fam.position_offset + 1
    if row >= t.rows:
        return Part("offsets", Status.SKIP, f"{label}{t.name}: too few rows for the marker probe",
                    details={"where": where}), None
    hit = _moved(subject, stack, t, [row], ids, enc, default)
    metrics = {"marker_row": row, "marker_positions": hit}
    if hit == [1]:
        return Part("offsets", Status.PASS, f"{label}{t.name}: row {row} is read at position 1 "
                    f"(offset {fam.position_offset}, as the family says)", metrics,
                    {"where": where}), fam.position_offset
    if not hit:
        return Part("offsets", Status.FAIL, f"{label}{t.name}: a marker in row {row} moves no position of "
                    f"0..{len(ids) - 1}: the model does not read this table at offset {fam.position_offset}",
                    metrics, {"where": where}), None
    actual = row - hit[0]
    return Part("offsets", Status.FAIL, f"{label}{t.name}: row {row} is read at position(s) {hit[:4]}, not 1: the "
                f"model's offset is {actual}, the family convention {fam.position_offset}", metrics,
                {"where": where, "model_offset": actual}), None


def _discover(subject: Subject, stack: str, t: PositionTable, ids, enc, default, label: str,
              where: str) -> tuple[Part, int | None]:
    """A family with no measured offsets: find the row position 0 reads (blocks of rows marked at
    once, then one row to confirm) and report it. What is wrong whatever the offset still FAILs: no
    row read at all, or rows not read in position order (row off+1 must move position 1 only)."""
    n = len(ids)
    limit = min(t.rows, DISCOVER_ROWS)
    forwards = 0
    for lo in range(0, limit, n):
        block = list(range(lo, min(lo + n, limit)))
        hit = _moved(subject, stack, t, block, ids, enc, default)
        forwards += 1
        if hit:
            break
    else:
        return Part("offsets", Status.FAIL, f"{label}{t.name}: markers in rows 0..{limit - 1} move no position of "
                    f"0..{n - 1}: the model does not read this table", {"marker_forwards": forwards},
                    {"where": where, "reads": "none"}), None
    # positions 0..c-1 read rows off..off+c-1 inside the block [lo, lo+n): off = block end - c
    offset = block[-1] + 1 - len(hit) if hit[0] == 0 else lo - hit[0]
    row = offset + 1
    single = _moved(subject, stack, t, [row], ids, enc, default) if 0 <= row < t.rows else []
    metrics = {"discovered_offset": offset, "marker_row": row, "marker_positions": single,
               "marker_forwards": forwards + 1}
    if single == [1]:
        return Part("offsets", Status.PASS, f"{label}{t.name}: position 0 reads row {offset} (offset discovered: "
                    f"{subject.family.name} has no row in posdiag's family table); row {row} is read at position 1",
                    metrics, {"where": where, "model_offset": offset}), offset
    shared = _row_read_by_all(subject, stack, t, block, ids, enc, default) if len(hit) == n else None
    if shared is not None:
        metrics["shared_row"] = shared
    return Part("offsets", Status.FAIL, f"{label}{t.name}: rows are not read in position order: markers in rows "
                f"{block[0]}..{block[-1]} moved positions {hit[:6]}, a marker in row {row} moved "
                f"{single[:6] or 'none'} "
                "(position 1 only expected, whatever the offset)", metrics,
                {"where": where, **({"reads": "one row"} if shared is not None else {})}), None


def _row_read_by_all(subject: Subject, stack: str, t: PositionTable, block: list[int], ids, enc,
                     default) -> int | None:
    """The one row of `block` whose marker moves every position (found by halving), or None."""
    everything = list(range(len(ids)))
    while len(block) > 1:
        half = block[: len(block) // 2]
        block = half if _moved(subject, stack, t, half, ids, enc, default) == everything else block[len(half):]
    return block[0] if _moved(subject, stack, t, block, ids, enc, default) == everything else None
