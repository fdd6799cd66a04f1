"""table — absolute position tables: capacity, the edge of the context, offsets, sinusoids, health.

Learned (GPT-2, BERT, OPT, BART, RoBERTa…) and fixed sinusoidal tables (Marian, DistilBERT's
option, the original Transformer) give each position p one row, added to the token embedding.
Four measurements and one inspection, per stack:

1. Capacity (behavioural): the same token at every position 0..N-1 of the declared context must
   give N distinct embedding outputs h(p). A table that clamps (p >= M looks like M-1) or wraps
   (p looks like p-M) makes two positions identical. For every p, the nearest *earlier* position
   q = argmin_{q<p} ||h(p) - h(q)|| is found over all earlier positions (not only neighbours);
   min ||h(p) - h(q)|| / median ||h|| is judged against a floor from the same run (the same
   positions computed again in other batch slots). Position ids in short rows where the family
   honours them (one forward however long the context), one long row where it derives them.
2. Past the declared context (position N): an error is correct; silent output is a WARN that
   says what was produced (an existing row past N, or a copy of an earlier position).
3. Offsets: the row the model's *own* computation reads for logical position 1 (a marker added
   to row `position_offset + 1` must move position 1 and nothing else), and, where position ids
   are taken, omitted ids vs ids passed by the family convention (+`explicit_position_offset`).
4. Sinusoidal tables: the layout (interleaved sin/cos or concatenated [sin|cos]) is detected from
   row 0 = (sin 0, cos 0); the table must equal sin(p θ_i), cos(p θ_i), θ_i = b^(-2i/d), and obey
   PE(p+k) = R(k θ_i) PE(p) per dim pair (fitted 2x2 maps, which must be rotations). Floors: the
   same formula evaluated in the table's own dtype.
5. Health (WARN only): an all-zero table, duplicate rows, a table that looks freshly initialised
   (adjacent-row cosine at chance, std = initializer_range) while the token embeddings do not,
   a table the checkpoint did not provide (the `load` check FAILs on that; here is the evidence).

Where each lives: discovery.py (finding the tables), stack.py (1-3 per stack, offsets first),
capacity.py, beyond.py, offsets.py, sinusoids.py, health.py; helpers.py holds `Part`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posdiag.checks import CheckSpec, Option
from posdiag.checks.table.capacity import DEFAULT_MAX_LONG_ROW, DEFAULT_MAX_PROBE
from posdiag.checks.table.discovery import TABLE_NAMES, PositionTable, declared_logical, find_tables
from posdiag.checks.table.health import health_parts
from posdiag.checks.table.helpers import Part
from posdiag.checks.table.sinusoids import sinusoid_part, sinusoid_report
from posdiag.checks.table.stack import stack_parts
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, Table

SPEC = CheckSpec(
    name="table",
    title="Position tables",
    proves="each position table gives every declared position a distinct, healthy row (sinusoids a fixed rotation)",
    options={
        "max_long_row": Option(DEFAULT_MAX_LONG_ROW, "longest single row of the edge probe: its attention scores "
                                                     "grow with the square of it (LED's 16384 rows asked for 2 GiB)"),
        "max_probe_positions": Option(DEFAULT_MAX_PROBE, "positions probed exhaustively; larger contexts are "
                                                         "sampled evenly"),
    },
)

__all__ = ["SPEC", "Part", "PositionTable", "find_tables", "run", "sinusoid_report"]


def run(subject: Subject, options: RunOptions) -> CheckResult:
    kind = subject.position_kind
    if kind not in ("learned", "sinusoidal"):
        why = {"rope": "RoPE rotates q/k by position: no table (see `rope`)",
               "alibi": "ALiBi adds a distance bias computed on the fly: no table",
               "relative_bias": "relative position buckets, not an absolute table (see `shuffle`)"}
        return SPEC.result(Status.NA, why.get(kind, f"no absolute position table ({kind})"),
                           details={"position_kind": kind})
    tables = find_tables(subject)
    if not tables:
        return SPEC.result(Status.SKIP, f"position kind {kind} but no 2D table named like "
                           f"{'/'.join(TABLE_NAMES)} was found: nothing to inspect", details={"position_kind": kind})

    settings = options.for_check(SPEC.name)
    parts: list[Part] = []
    tables_out: list[Table] = []
    declared = declared_logical(subject)
    own_offsets: dict[str, int] = {}  # table name -> row read at position 0 (the family's, or discovered)
    not_positions: dict[str, str] = {}  # table name -> why it is no table of token positions (offset_parts)
    for stack in subject.stacks:
        stack_tables = [t for t in tables if t.stack == stack]
        parts += stack_parts(subject, options, settings, stack, stack_tables, declared, tables_out, own_offsets,
                             not_positions)
    for t in (t for t in tables if t.name not in not_positions):
        with subject.stored_weight(t.name) as values:  # offloaded (meta) tables: read from accelerate's map
            stored = replace(t, tensor=values)
            if kind == "sinusoidal":
                parts.append(sinusoid_part(stored, subject, own_offsets.get(t.name)))
            parts += health_parts(subject, stored, declared, own_offsets.get(t.name))

    # A passing health inspection alone (no zero or duplicate rows) probes nothing: with every probe
    # skipped the check is a SKIP, never a PASS.
    judged = [p.status for p in parts
              if p.status is not Status.SKIP and not (p.name == "health" and p.status is Status.PASS)]
    status = Status.worst(judged) if judged else Status.SKIP
    metrics: dict[str, Any] = {}
    details: dict[str, Any] = {"position_kind": kind, "declared_positions": declared, "not_positions": not_positions,
                               "tables": {t.name: {"rows": t.rows, "dim": t.dim, "stack": t.stack} for t in tables},
                               "parts": {}}
    bad = [p for p in parts if p.status is status]
    lead = bad[0] if bad else parts[0]
    for p in parts:
        details["parts"].setdefault(p.name, []).append({"status": p.status.value, "message": p.message, **p.details})
        for k, v in p.metrics.items():
            metrics[f"{p.details.get('where', '')}{k}"] = v
    metrics.update(lead.metrics)  # the numbers behind the summary line, unprefixed
    summary = lead.message if status is not Status.PASS else _pass_summary(parts)
    if len(bad) > 1 and status is not Status.PASS:
        summary += f" (+{len(bad) - 1} more {status.value})"
    tables_out.append(Table("table findings", ("part", "status", "finding"),
                            tuple((p.name, p.status.value, p.message) for p in parts)))
    return SPEC.result(status, summary, metrics, details, tables_out)


def _pass_summary(parts: list[Part]) -> str:
    """The capacity line, the other parts that passed, and what was not probed (a part that was not probed
    is never counted as ok)."""
    cap = [p for p in parts if p.name == "capacity" and p.status is Status.PASS]
    passed = [p for p in parts if p.status is Status.PASS]
    text = (cap or passed)[0].message
    extra = sorted({p.name for p in passed if p is not (cap or passed)[0]})
    skipped = [p for p in parts if p.status is Status.SKIP]
    return (text + (f"; {', '.join(extra)} ok" if extra else "")
            + (f"; not probed: {'; '.join(p.message for p in skipped)}" if skipped else ""))
