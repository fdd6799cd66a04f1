"""Past the declared context (position N): an error is correct; silent output is a WARN that says
what was produced (an existing row past N, or a copy of an earlier position).

An error counts as the model's refusal only when the model raised it (not posdiag: that is raised,
so the run reports an error) and the capacity probe ran the same path up to N-1 without one. On a
device where an out-of-range lookup is a device-side assert, N is not probed: a SKIP for this part."""

from __future__ import annotations

import torch

from posdiag.checks.table.discovery import PositionTable
from posdiag.checks.table.helpers import Part, encoder_ids
from posdiag.errors import one_line, raised_in_posdiag
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.results import Status
from posdiag.verdict import agreement_tolerance


def beyond(subject: Subject, stack: str, declared: int, token: int, honoured: bool,
           tables: list[PositionTable], outputs: dict, label: str, where: str, offset: int) -> Part:
    row_needed = declared + offset
    rows = min((t.rows for t in tables), default=None)
    if subject.device.type != "cpu" and (rows is None or row_needed >= rows):
        return Part("beyond", Status.SKIP, f"{label}position {declared} not probed on {subject.device.type}: an "
                    f"out-of-range lookup is a device-side assert that ends the process; the table has {rows} rows, "
                    f"row {row_needed} does not exist", {"beyond_probed": False}, {"where": where})
    try:
        if honoured:
            ids = torch.full((1,), token, dtype=torch.long)
            out = run_rows(subject, [Row(ids, positions=torch.tensor([declared]))], stack=stack,
                           encoder_ids=encoder_ids(subject, stack, ids, 1))
            h = out.hidden[0][0, 0]
        else:
            ids = torch.full((declared + 1,), token, dtype=torch.long)
            out = run_rows(subject, [Row(ids)], stack=stack,
                           encoder_ids=encoder_ids(subject, stack, ids, 1))
            h = out.hidden[0][0, -1]
    except Exception as exc:
        if raised_in_posdiag(exc):  # posdiag's own bug: the run reports an error, never a verdict
            raise
        if not outputs:  # the same path inside the context failed too: the error says nothing about N
            return Part("beyond", Status.SKIP, f"{label}position {declared} not judged: the model raised "
                        f"{type(exc).__name__} there, as it did inside the declared context (see capacity)",
                        {"beyond_probed": False}, {"where": where, "error": one_line(exc)})
        # The capacity probe ran the same path up to position N-1: the model refuses position N itself.
        return Part("beyond", Status.PASS, f"{label}position {declared} (one past the declared {declared}) raises "
                    f"{type(exc).__name__}", {"beyond_raises": True},
                    {"where": where, "error": one_line(exc)})
    how = "produced output"
    q = None
    if outputs:
        hh = outputs["h"]
        d = (hh - h.double().cpu()).norm(dim=-1) / outputs["scale"]
        i = int(d.argmin())
        if float(d[i]) <= agreement_tolerance(outputs["floor"], subject.dtype_name):
            q = int(outputs["positions"][i])
            how = f"reused position {q}'s embedding (indices clamped or wrapped)"
    if q is None:
        if rows is not None and row_needed < rows:
            how = (f"read row {row_needed} of a {rows}-row table: {rows - offset - declared} row(s) exist past the "
                   "declared context (never trained at that length, presumably)")
        else:
            how = (f"produced a distinct output although the table has no row {row_needed} at the family's offset "
                   f"{offset} ({rows} rows): is the offset right?")
    return Part("beyond", Status.WARN, f"{label}position {declared}, one past the declared context, silently {how}",
                {"beyond_raises": False}, {"where": where, "beyond_twin": q})
