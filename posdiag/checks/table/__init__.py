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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posdiag.model.checkpoint import in_checkpoint
from posdiag.options import RunOptions
from posdiag.model.probe import Row, run_rows
from posdiag.results import CheckResult, Status, Table
from posdiag.model.subject import Subject
from posdiag.verdict import FAIL_RATIO, MACHINE_EPSILON, agreement_tolerance, judge_agreement, judge_position_signal

TITLE = "Position tables"

# Parameter / buffer names that hold an absolute position table (2D: rows x dim).
TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings", "position_table", "pos_emb", "pos_embed")
EXCLUDE = ("token_type", "relative", "inv_freq", "rotary")
ROW_TOKENS = 64          # positions per row of the capacity probe (position ids passed)
DEFAULT_MAX_PROBE = 16384  # positions probed exhaustively; larger contexts are sampled evenly
OFFSET_LEN = 16          # tokens of the offset / marker probes
DISCOVER_ROWS = 1024     # rows searched for the first one read, for a family with no measured offset


@dataclass
class PositionTable:
    name: str
    stack: str
    tensor: torch.Tensor
    trainable: bool

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def dim(self) -> int:
        return int(self.tensor.shape[1])


@dataclass
class Part:
    """One measurement's verdict, to be folded into the check's result."""

    name: str
    status: Status
    message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


# ====================================================================== entry point
def run(subject: Subject, options: RunOptions) -> CheckResult:
    kind = subject.position_kind
    if kind not in ("learned", "sinusoidal"):
        why = {"rope": "RoPE rotates q/k by position: no table (see `rope`)",
               "alibi": "ALiBi adds a distance bias computed on the fly: no table",
               "relative_bias": "relative position buckets, not an absolute table (see `shuffle`)"}
        return CheckResult("table", Status.SKIP, why.get(kind, f"no absolute position table ({kind})"),
                           details={"position_kind": kind})
    tables = find_tables(subject)
    if not tables:
        return CheckResult("table", Status.SKIP, f"position kind {kind} but no 2D table named like "
                           f"{'/'.join(TABLE_NAMES)} was found: nothing to inspect", details={"position_kind": kind})

    settings = options.for_check("table")
    parts: list[Part] = []
    tables_out: list[Table] = []
    declared = _declared_logical(subject)
    own_offsets: dict[str, int] = {}  # table name -> row read at position 0 (the family's, or discovered)
    for stack in subject.stacks:
        stack_tables = [t for t in tables if t.stack == stack]
        parts += _stack_parts(subject, options, settings, stack, stack_tables, declared, tables_out, own_offsets)
    for t in tables:
        with subject.stored_weight(t.name) as values:  # offloaded (meta) tables: read from accelerate's map
            stored = replace(t, tensor=values)
            if kind == "sinusoidal":
                parts.append(_sinusoid_part(stored, subject))
            parts += _health_parts(subject, stored, declared, own_offsets.get(t.name))

    judged = [p.status for p in parts if p.status is not Status.SKIP]
    status = Status.worst(judged) if judged else Status.SKIP
    metrics: dict[str, Any] = {}
    details: dict[str, Any] = {"position_kind": kind, "declared_positions": declared,
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
    return CheckResult("table", status, summary, metrics, details, tuple(tables_out))


def _pass_summary(parts: list[Part]) -> str:
    cap = [p for p in parts if p.name == "capacity"]
    text = cap[0].message if cap else parts[0].message
    extra = [p.name for p in parts if p.name != "capacity"]
    return text + (f"; {', '.join(sorted(set(extra)))} ok" if extra else "")


# ====================================================================== discovery
def find_tables(subject: Subject) -> list[PositionTable]:
    """2D parameters/buffers named like a position table, each assigned to its stack."""
    found: list[PositionTable] = []
    seen: set[int] = set()
    named = list(subject.model.named_parameters()) + list(subject.model.named_buffers())
    for name, tensor in named:
        low = name.lower()
        if tensor.ndim != 2 or not any(k in low for k in TABLE_NAMES) or any(k in low for k in EXCLUDE):
            continue
        key = id(tensor) if tensor.device.type == "meta" else tensor.data_ptr()  # offloaded: all at address 0
        if key in seen:
            continue
        seen.add(key)
        parts = name.split(".")
        stack = subject.stacks[0]
        for s in subject.stacks:
            if s in parts and len(subject.stacks) > 1:
                stack = s
        trainable = bool(getattr(tensor, "requires_grad", False))
        found.append(PositionTable(name, stack, tensor, trainable))
    return found


def _declared_logical(subject: Subject) -> int | None:
    """Logical positions the config promises (Subject.max_positions already takes RoBERTa's
    padding_idx+1 offset rows out of max_position_embeddings)."""
    return subject.max_positions


# ====================================================================== per stack
def _stack_parts(subject: Subject, options: RunOptions, settings: dict, stack: str,
                 tables: list[PositionTable], declared: int | None, out_tables: list[Table],
                 own_offsets: dict[str, int]) -> list[Part]:
    where = f"{stack}_" if len(subject.stacks) > 1 else ""
    label = f"{stack}: " if len(subject.stacks) > 1 else ""
    parts: list[Part] = []
    token = int(subject.sample_ids(1, 1, options.seed)[0, 0])
    sizes = {f"table_rows_{t.name}": t.rows for t in tables}

    # 3. offsets first: they also tell whether position ids are really honoured and, for a family
    # posdiag has no row for, which row each probe reads.
    offset_parts, honoured, found = _offset_parts(subject, options, stack, tables, label, where)
    parts += offset_parts
    own_offsets.update(found["own"])
    offset = found["probe"]  # the row the capacity/beyond probes read for logical position 0

    rows_cap = min((t.rows - offset for t in tables), default=None)
    if (found["discovered"] and rows_cap is not None and declared is not None and rows_cap < declared
            and min(t.rows for t in tables) >= declared):
        # RoBERTa's convention: max_position_embeddings counts the offset rows. Whatever the offset,
        # the table holds every row the model's own numbering can read; only rows_cap positions exist.
        parts.append(Part("offsets", Status.PASS, f"{label}the declared {declared} positions count the "
                          f"{offset} offset row(s), as RoBERTa's config does: {rows_cap} usable positions",
                          {"usable_positions": rows_cap}, {"where": where}))
        declared = rows_cap
    n = declared if declared is not None else rows_cap
    if n is None:
        return parts + [Part("capacity", Status.SKIP, f"{label}no declared context and no table rows to size the probe",
                             details={"where": where})]
    static_short = rows_cap is not None and declared is not None and rows_cap < declared
    if static_short:
        t = min(tables, key=lambda x: x.rows)
        parts.append(Part("capacity", Status.FAIL,
                          f"{label}table {t.name} has {t.rows} rows (first position at row {offset}): positions "
                          f"{rows_cap}..{declared - 1} of the declared {declared} have no row",
                          {"table_rows": t.rows, "declared_positions": declared},
                          {"where": where, "first_bad_position": rows_cap}))
        n = rows_cap

    # 1. capacity
    cap, outputs = _capacity(subject, settings, stack, n, token, honoured, label, where)
    cap.metrics.update({"declared_positions": declared, "position_offset": offset, **sizes})
    parts.append(cap)
    if cap.details.get("table"):
        out_tables.append(cap.details.pop("table"))

    # 2. past the declared context
    if declared is not None and not static_short:
        parts.append(_beyond(subject, stack, declared, token, honoured, tables, outputs, label, where, offset))
    return parts


# ---------------------------------------------------------------------- capacity
def _capacity(subject: Subject, settings: dict, stack: str, n: int, token: int, honoured: bool,
              label: str, where: str) -> tuple[Part, dict]:
    limit = int(settings.get("max_probe_positions", DEFAULT_MAX_PROBE))
    if n <= limit:
        positions = torch.arange(n)
    else:  # evenly spaced, always including both ends
        positions = torch.unique(torch.cat([torch.linspace(0, n - 1, limit).round().long(), torch.tensor([n - 1])]))
    dtype = subject.dtype_name
    before = subject.forward_count
    try:
        if honoured:
            h_all, count, floor_pairs = _probe_short_rows(subject, stack, positions, token)
            h = h_all[:count]
        else:
            h_all, count, floor_pairs = _probe_long_row(subject, stack, int(positions.max()) + 1, token)
            h = h_all[:count][positions]
    except Exception as exc:  # an index error inside the declared range is itself the finding
        return Part("capacity", Status.FAIL, f"{label}probing positions 0..{n - 1} raised "
                    f"{type(exc).__name__}: {_one_line(exc)}", details={"where": where}), {}
    if not torch.isfinite(h).all():
        bad = int(torch.nonzero(~torch.isfinite(h).all(-1))[0, 0])
        return Part("capacity", Status.FAIL, f"{label}non-finite embedding output at position {int(positions[bad])}",
                    details={"where": where, "first_bad_position": int(positions[bad])}), {}
    scale = float(h.norm(dim=-1).median()) or 1.0
    floor = max((float((h_all[a] - h_all[b]).norm()) for a, b in floor_pairs), default=0.0) / scale
    dist, twin = _nearest_earlier(h)
    dist = dist / scale
    line = agreement_tolerance(floor, dtype)
    min_i = int(torch.argmin(dist[1:])) + 1 if len(dist) > 1 else 0
    verdict = judge_position_signal(float(dist[min_i]) if len(dist) > 1 else float("inf"), floor, dtype)
    metrics = {"positions_probed": int(len(positions)), "capacity_min_distance": verdict.residual,
               "capacity_noise_floor": verdict.noise_floor, "capacity_ratio": verdict.ratio,
               "capacity_forwards": subject.forward_count - before}
    details: dict[str, Any] = {"where": where, "probe": "position ids, rows of %d" % ROW_TOKENS if honoured
                               else "one row of the same token (positions derived by the model)",
                               "closest_pair": [int(positions[twin[min_i]]), int(positions[min_i])]}
    outputs = {"h": h, "positions": positions, "scale": scale, "floor": floor}
    how = f"{len(positions)} positions in {metrics['capacity_forwards']} forward(s)"
    if verdict.status is Status.PASS:
        msg = (f"{label}{how}: every position distinct; closest pair {int(positions[twin[min_i]])}/"
               f"{int(positions[min_i])} at {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor")
        return Part("capacity", Status.PASS, msg, metrics, details), outputs
    bad = torch.nonzero(dist <= line).flatten()
    bad = bad[bad > 0]
    if len(bad) == 0:  # WARN band: nothing below the fail line, but too close to call
        return Part("capacity", verdict.status, f"{label}{how}: closest pair {int(positions[twin[min_i]])}/"
                    f"{int(positions[min_i])} at {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor: "
                    f"{verdict.reason}", metrics, details), outputs
    first = int(bad[0])
    p, q = int(positions[first]), int(positions[twin[first]])
    pattern = _pattern(h, positions, bad, twin, line * scale)
    details.update({"first_bad_position": p, "twin": q, "colliding_positions": int(len(bad)), "pattern": pattern})
    metrics.update({"first_bad_position": p, "twin": q})
    text = {"none": f"no two positions can be told apart (position {p} == position {q}): no position signal",
            "clamp": f"every position from {p} on looks like position {q}: indices clamp at {q} "
                     f"({q + 1} usable positions of {n})",
            "wrap": f"position p looks like p-{p - q} from {p} on: indices wrap modulo {p - q}"}.get(
        pattern, f"position {p} looks like position {q} ({len(bad)} positions collide)")
    status = verdict.status if verdict.status is not Status.PASS else Status.FAIL
    note = f" [{verdict.reason}]" if status is Status.WARN else ""
    return Part("capacity", status, f"{label}{text}; distance {verdict.residual:.2g} = {verdict.ratio:.3g}x noise "
                f"floor ({how}){note}", metrics, details), outputs


def _probe_short_rows(subject: Subject, stack: str, positions: torch.Tensor, token: int):
    """All positions in one forward: rows of ROW_TOKENS tokens (the same token) with consecutive
    position ids; the embedding output of each token depends on its own position only. A second,
    shifted layout of a few rows puts the same positions in other slots: the noise floor."""
    t = min(ROW_TOKENS, len(positions))
    pad = (-len(positions)) % t
    main = torch.cat([positions, positions[:pad]]) if pad else positions
    shifted = torch.roll(main, t // 2)[: min(len(main), 4 * t)]
    chunks = list(main.view(-1, t)) + list(shifted.view(-1, t))
    ids = torch.full((t,), token, dtype=torch.long)
    rows = [Row(ids, positions=c) for c in chunks]
    out = run_rows(subject, rows, stack=stack, encoder_ids=_encoder_ids(subject, stack, ids, len(rows)))
    h0 = out.hidden[0]
    n_main = main.numel() // t
    h = h0[:n_main].reshape(-1, h0.shape[-1])[: len(positions)].double().cpu()
    second = h0[n_main:].reshape(-1, h0.shape[-1]).double().cpu()
    index = {int(p): i for i, p in enumerate(positions)}
    pairs = [(index[int(p)], len(h) + j) for j, p in enumerate(shifted)]
    return torch.cat([h, second]), len(h), pairs


def _probe_long_row(subject: Subject, stack: str, length: int, token: int):
    """One row of `length` copies of the token (the model derives positions itself), twice."""
    ids = torch.full((length,), token, dtype=torch.long)
    rows = [Row(ids), Row(ids)]
    out = run_rows(subject, rows, stack=stack, encoder_ids=_encoder_ids(subject, stack, ids, 2))
    h = torch.cat([out.hidden[0][0], out.hidden[0][1]]).double().cpu()
    step = max(1, length // 256)
    return h, length, [(i, length + i) for i in range(0, length, step)]


def _nearest_earlier(h: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row p: the distance to the nearest row q < p and q (row 0: inf, -1).

    Candidates come from a Gram-matrix screen (float64); the chosen pair's distance is then
    recomputed directly, so exact duplicates read exactly 0."""
    n = h.shape[0]
    sq = (h * h).sum(-1)
    dist = torch.full((n,), float("inf"), dtype=torch.float64)
    twin = torch.full((n,), -1, dtype=torch.long)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu()  # column q >= row p: not earlier
    for start in range(1, n, chunk):
        stop = min(n, start + chunk)
        block = h[start:stop]
        d2 = torch.addmm(sq[None, :stop], block, h[:stop].T, alpha=-2.0)
        d2.add_(sq[start:stop, None])
        d2[:, start:stop].masked_fill_(upper[: stop - start, : stop - start], float("inf"))
        q = d2.argmin(-1)
        twin[start:stop] = q
        dist[start:stop] = (block - h[q]).norm(dim=-1)
    return dist, twin


def _pattern(h: torch.Tensor, positions: torch.Tensor, bad: torch.Tensor, twin: torch.Tensor, line: float) -> str:
    first = int(bad[0])
    q0 = int(twin[first])
    p_first, p_twin = int(positions[first]), int(positions[q0])
    tail = torch.arange(first, len(positions))
    same_as_twin = (h[tail] - h[q0]).norm(dim=-1) <= line
    if bool(same_as_twin.all()):
        return "none" if p_twin == 0 and p_first == int(positions[1]) else "clamp"
    shift = p_first - p_twin
    if shift > 0 and all(int(positions[int(b)]) - shift >= 0 for b in bad):
        lookup = {int(p): i for i, p in enumerate(positions)}
        ok = [lookup.get(int(positions[int(b)]) - shift) for b in tail]
        if all(o is not None for o in ok) and bool(
                ((h[tail] - h[torch.tensor(ok)]).norm(dim=-1) <= line).all()):
            return "wrap"
    return "collide"


# ---------------------------------------------------------------------- past the context
def _beyond(subject: Subject, stack: str, declared: int, token: int, honoured: bool,
            tables: list[PositionTable], outputs: dict, label: str, where: str, offset: int) -> Part:
    row_needed = declared + offset
    rows = min((t.rows for t in tables), default=None)
    if subject.device.type != "cpu" and (rows is None or row_needed >= rows):
        return Part("beyond", Status.PASS, f"{label}position {declared} not probed on {subject.device.type}: an "
                    f"out-of-range lookup is a device-side assert; the table has {rows} rows, row {row_needed} "
                    "does not exist", {"beyond_probed": False}, {"where": where})
    try:
        if honoured:
            ids = torch.full((1,), token, dtype=torch.long)
            out = run_rows(subject, [Row(ids, positions=torch.tensor([declared]))], stack=stack,
                           encoder_ids=_encoder_ids(subject, stack, ids, 1))
            h = out.hidden[0][0, 0]
        else:
            ids = torch.full((declared + 1,), token, dtype=torch.long)
            out = run_rows(subject, [Row(ids)], stack=stack,
                           encoder_ids=_encoder_ids(subject, stack, ids, 1))
            h = out.hidden[0][0, -1]
    except Exception as exc:
        return Part("beyond", Status.PASS, f"{label}position {declared} (one past the declared {declared}) raises "
                    f"{type(exc).__name__}", {"beyond_raises": True},
                    {"where": where, "error": _one_line(exc)})
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


# ---------------------------------------------------------------------- offsets
def _offset_parts(subject: Subject, options: RunOptions, stack: str, tables: list[PositionTable],
                  label: str, where: str) -> tuple[list[Part], bool, dict[str, Any]]:
    """Markers (which row the model's own numbering reads at position 1), then omitted vs passed ids.

    Returns the parts, whether ids are honoured, and the offsets: "own" (table -> row read at
    position 0 without ids), "probe" (row read at logical position 0 by the capacity/beyond probes)
    and "discovered" (the family has no measured row: the offsets were found, not assumed)."""
    fam = subject.family
    dtype = subject.dtype_name
    length = OFFSET_LEN
    ids = subject.sample_ids(1, length, options.seed + 1)[0]
    enc = ids[None] if subject.kind == "seq2seq" and stack == "decoder" else None
    default = subject.forward(ids[None], stack=stack, encoder_ids=enc).hidden[0][0]
    parts: list[Part] = []
    honoured = fam.takes_position_ids
    own: dict[str, int] = {}
    for t in tables:
        part, row0 = (_marker(subject, stack, t, ids, enc, default, label, where) if fam.offsets_known
                      else _discover(subject, stack, t, ids, enc, default, label, where))
        parts.append(part)
        if row0 is not None:
            own[t.name] = row0
    discovered = not fam.offsets_known and bool(own)
    own_offset = next(iter(own.values()), fam.position_offset) if discovered else fam.position_offset
    found: dict[str, Any] = {"own": own, "probe": own_offset, "discovered": discovered}

    if fam.takes_position_ids:
        shifts = [s for s in (-2, -1, 0, 1, 2) if s >= -fam.position_offset - fam.explicit_position_offset]
        if discovered:  # passed id x reads row x + k; k is 0 or OPT's 2 in practice: shift own-k matches
            shifts = sorted(set(shifts) | {s for s in (own_offset, own_offset - 1, own_offset - 2) if s > 2})
        try:
            out = _shifted(subject, stack, ids, enc, shifts)
        except Exception:  # a negative shift below the table's first row (a wrong offset, say)
            shifts = [0, 1, 2]
            out = _shifted(subject, stack, ids, enc, shifts)
        err = {s: _rel(out.hidden[0][i], default) for i, s in enumerate(shifts)}
        agree = judge_agreement(err[0], 0.0, dtype)
        moved = judge_position_signal(err[1], 0.0, dtype)  # a shift must move far above rounding
        honoured = moved.status is Status.PASS
        metrics = {"offset_error": err[0], "offset_shift_effect": err[1]}
        match = [s for s in shifts if s != 0 and judge_agreement(err[s], 0.0, dtype).status is Status.PASS]
        if not honoured:
            parts.append(Part("offsets", Status.SKIP,
                              f"{label}shifting the passed position ids by 1 changes the embeddings by only "
                              f"{err[1]:.2g}: ids not honoured (or no position signal); omitted-vs-passed not judged",
                              metrics, {"where": where}))
        elif agree.status is Status.PASS:
            parts.append(Part("offsets", Status.PASS, f"{label}ids omitted == ids passed as logical+"
                              f"{fam.explicit_position_offset} (error {err[0]:.2g})", metrics, {"where": where}))
        elif discovered and match:
            # No convention to judge against: which ids reproduce the model's own numbering is information.
            found["probe"] = own_offset - match[0]
            parts.append(Part("offsets", Status.PASS, f"{label}the model's own positions are ids passed as "
                              f"logical{match[0]:+d} (error {err[match[0]]:.2g}; posdiag passes logical+0: "
                              f"{fam.name} has no row in posdiag's family table)", {**metrics, "matching_shift": match[0]},
                              {"where": where, "matching_shift": match[0]}))
        else:
            said = (f"the model's own positions are the convention shifted by {match[0]:+d}" if match
                    else "no small shift explains it")
            status = Status.FAIL if fam.offsets_known else Status.WARN  # no convention known: inconclusive
            parts.append(Part("offsets", status, f"{label}ids omitted != ids passed as logical+"
                              f"{fam.explicit_position_offset} (error {err[0]:.2g} = {agree.ratio:.3g}x floor): {said}",
                              metrics, {"where": where, "matching_shift": match[0] if match else None}))
    return parts, honoured, found


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
    line = FAIL_RATIO * MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7)
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
                    f"(offset {fam.position_offset}, as the family says)", metrics, {"where": where}), fam.position_offset
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
                    {"where": where}), None
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
    return Part("offsets", Status.FAIL, f"{label}{t.name}: rows are not read in position order: markers in rows "
                f"{block[0]}..{block[-1]} moved positions {hit[:6]}, a marker in row {row} moved {single[:6] or 'none'} "
                "(position 1 only expected, whatever the offset)", metrics, {"where": where}), None


# ====================================================================== sinusoids
def _sinusoid_part(t: PositionTable, subject: Subject) -> Part:
    where = f"{t.stack}_" if len(subject.stacks) > 1 else ""
    rep = sinusoid_report(t.tensor.detach())
    metrics = {k: rep[k] for k in ("formula_error", "formula_floor", "rotation_residual", "rotation_floor", "base")}
    details = {"where": where, "layout": rep["layout"], "table": t.name}
    if rep["status"] is Status.PASS:
        return Part("sinusoid", Status.PASS, f"{t.name}: {rep['layout']} sin/cos, base {rep['base']:.6g}; formula error "
                    f"{rep['formula_error']:.2g} (floor {rep['formula_floor']:.2g}), PE(p+k)=R_k PE(p) residual "
                    f"{rep['rotation_residual']:.2g}", metrics, details)
    return Part("sinusoid", Status.FAIL, f"{t.name}: not a sinusoid table: {rep['reason']} (overwritten at init?)",
                metrics, details)


def sinusoid_report(table: torch.Tensor) -> dict[str, Any]:
    """Detect layout and base, measure formula error and the rotation property (see the docstring)."""
    dtype = table.dtype if table.dtype.is_floating_point else torch.float32
    name = str(dtype).removeprefix("torch.")
    w = table.detach().double().cpu()
    p_count, d = w.shape
    half = d // 2
    sin_start_cos = (d + 1) // 2
    layouts = {"interleaved": (torch.arange(0, 2 * half, 2), torch.arange(1, 2 * half, 2)),
               "concatenated": (torch.arange(half), torch.arange(sin_start_cos, sin_start_cos + half))}
    # the same two layouts with cos first ([cos|sin], cos/sin pairs) also exist in the wild
    layouts.update({f"{k} (cos first)": (c, s) for k, (s, c) in list(layouts.items())})
    row0 = {k: float(torch.cat([w[0, s].abs(), (w[0, c] - 1).abs()]).max()) for k, (s, c) in layouts.items()}
    layout = min(row0, key=row0.get)
    s_idx, c_idx = layouts[layout]
    i = torch.arange(half, dtype=torch.float64)

    def formula(base: float, stored: torch.dtype) -> torch.Tensor:
        """The formula computed the way a table is built in practice: angles in float32 (or the
        table's own dtype when wider), the result stored in the table's dtype."""
        compute = stored if stored in (torch.float64, torch.float32) else torch.float32
        pos = torch.arange(p_count, dtype=compute)[:, None]
        theta = (base ** (-2 * i / d)).to(compute)
        ang = pos * theta
        return torch.stack([torch.sin(ang), torch.cos(ang)], -1).to(stored).double()

    got = torch.stack([w[:, s_idx], w[:, c_idx]], -1)  # [P, half, 2]
    bases = [10000.0]
    if p_count > 1:
        theta = torch.atan2(got[1, :, 0], got[1, :, 1])
        ok = (theta[1:] > 0) & torch.isfinite(theta[1:])
        if bool(ok.all()) and half > 1:
            x = 2 * i[1:] / d
            ln_b = float(-(x * torch.log(theta[1:])).sum() / (x * x).sum())
            if math.isfinite(ln_b) and 0 < ln_b < 100:
                bases.append(math.exp(ln_b))
    best = None
    for base in bases:
        exact = formula(base, torch.float64)
        err = float((got - exact).abs().max())
        if best is None or err < best[1]:
            best = (base, err, exact)
    base, err, exact = best
    floor = float((formula(base, dtype) - exact).abs().max())
    verdict = judge_agreement(err, floor, name)
    rot, rot_floor = _rotation_residual(got), _rotation_residual(formula(base, dtype))
    rot_verdict = judge_agreement(rot, rot_floor, name)
    reason = ""
    if row0[layout] > agreement_tolerance(floor, name):
        reason = f"row 0 is not (sin 0, cos 0) = (0, 1) in either layout (off by {row0[layout]:.2g})"
    elif verdict.status is not Status.PASS:
        reason = f"differs from the sinusoid formula by {err:.2g} = {verdict.ratio:.3g}x floor {verdict.noise_floor:.2g}"
    elif rot_verdict.status is not Status.PASS:
        reason = f"PE(p+k) is not a rotation of PE(p): residual {rot:.2g} = {rot_verdict.ratio:.3g}x floor"
    status = Status.PASS if not reason else Status.FAIL
    return {"status": status, "reason": reason, "layout": layout, "base": base, "formula_error": err,
            "formula_floor": verdict.noise_floor, "rotation_residual": rot, "rotation_floor": rot_verdict.noise_floor,
            "row0_error": row0[layout]}


def _rotation_residual(pairs: torch.Tensor) -> float:
    """max over k in {1, 3, P/3} and dim pairs of the relative residual of the best 2x2 map
    X[p+k] = M X[p], plus how far each fitted M is from a rotation (||MᵀM - I||)."""
    p_count = pairs.shape[0]
    worst = 0.0
    for k in sorted({1, 3, max(1, p_count // 3)}):
        if k >= p_count - 2:
            continue
        a = pairs[:-k].transpose(0, 1)  # [half, P-k, 2]
        b = pairs[k:].transpose(0, 1)
        m = torch.linalg.lstsq(a, b).solution  # b ≈ a @ m
        resid = (a @ m - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2)).clamp_min(1e-30)
        eye = torch.eye(2, dtype=m.dtype)
        ortho = (m.transpose(1, 2) @ m - eye).abs().amax(dim=(1, 2))
        worst = max(worst, float(resid.max()), float(ortho.max()))
    return worst


# ====================================================================== health
def _health_parts(subject: Subject, t: PositionTable, declared: int | None, offset: int | None) -> list[Part]:
    where = f"{t.stack}_" if len(subject.stacks) > 1 else ""
    offset = subject.family.position_offset if offset is None else offset
    n = declared if declared is not None else t.rows - offset
    used = t.tensor.detach()[offset: offset + n].double().cpu()
    parts: list[Part] = []
    missing = _missing_from_checkpoint(subject, t.name)
    if missing:
        parts.append(Part("health", Status.WARN, f"{t.name} is not in the checkpoint: its values are the init's "
                          "(`load` fails on this)", details={"where": where}))
    if used.numel() == 0:
        return parts
    if float(used.abs().max()) == 0.0:
        parts.append(Part("health", Status.WARN, f"{t.name}: all {len(used)} rows are zero: the table adds nothing, "
                          "so positions cannot enter through it", {"zero_rows": len(used)}, {"where": where}))
        return parts
    dups = _duplicate_rows(used, MACHINE_EPSILON.get(str(t.tensor.dtype).removeprefix("torch."), 1.2e-7))
    if dups:
        r, q = dups[0]
        parts.append(Part("health", Status.WARN, f"{t.name}: {len(dups)} row(s) duplicate other rows (position {r} "
                          f"== position {q}): those positions cannot be told apart",
                          {"duplicate_rows": len(dups)}, {"where": where}))
    if subject.position_kind == "learned":
        fresh = _fresh_init_evidence(subject, used)
        if fresh:
            parts.append(Part("health", Status.WARN, f"{t.name}: {fresh}", details={"where": where}))
    if not parts:
        parts.append(Part("health", Status.PASS, f"{t.name}: no zero or duplicate rows", details={"where": where}))
    return parts


def _duplicate_rows(rows: torch.Tensor, eps: float) -> list[tuple[int, int]]:
    """(later, earlier) pairs of rows equal within rounding. Rows are sorted by a random
    projection: equal rows project equally, so they end up next to each other."""
    scale = float(rows.norm(dim=-1).median()) or 1.0
    proj = rows @ torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=rows.dtype)
    order = torch.argsort(proj, stable=True)
    close = (rows[order[1:]] - rows[order[:-1]]).norm(dim=-1) / scale <= FAIL_RATIO * eps
    pairs = {}
    for i in torch.nonzero(close).flatten().tolist():
        a, b = int(order[i]), int(order[i + 1])
        pairs[max(a, b)] = min(pairs.get(max(a, b), min(a, b)), min(a, b))
    return sorted(pairs.items())


def _missing_from_checkpoint(subject: Subject, name: str) -> bool:
    info = subject.load_info
    if info.checkpoint_keys is None or name not in subject.model.state_dict():
        return False
    return name in info.missing_keys or not in_checkpoint(name, set(info.checkpoint_keys))


def _adjacent_cosine(rows: torch.Tensor, gap: int = 1) -> tuple[float, float]:
    """Mean cosine between rows r and r+gap, and its standard error for independent isotropic rows."""
    a, b = rows[:-gap], rows[gap:]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return float(cos.mean()), 1.0 / math.sqrt(rows.shape[1] * max(1, len(cos)))


def _fresh_init_evidence(subject: Subject, used: torch.Tensor) -> str:
    """A table that looks like N(0, initializer_range) noise while the token embeddings do not.

    Trained tables are smooth (adjacent rows correlate); a fresh init has adjacent-row cosine at
    chance (|mean| within 4 standard errors of 0) and the init's std (within 15% of
    initializer_range, where the config gives one). 'The rest is trained' needs evidence too: the
    token embedding rows correlate (mean cosine beyond 8 standard errors) or their std is not the
    init's. Both must hold, or nothing is said (a default-init model is random everywhere)."""
    if len(used) < 8:
        return ""
    c_adj, se = _adjacent_cosine(used)
    c_far, se_far = _adjacent_cosine(used, gap=max(1, len(used) // 2))
    if abs(c_adj) > 4 * se or abs(c_far) > 4 * se_far:
        return ""
    emb = subject.model.get_input_embeddings() if hasattr(subject.model, "get_input_embeddings") else None
    if emb is None or getattr(emb, "weight", None) is None:
        return ""
    emb_name = next((n for n, m in subject.model.named_modules() if m is emb), None)
    if emb_name is None:
        return ""
    with subject.stored_weight(f"{emb_name}.weight") as weight:  # offloaded embeddings: read from accelerate's map
        tok = weight.detach()[: 4096].double().cpu()
    c_tok, se_tok = _adjacent_cosine(tok)
    init = getattr(subject.config, "initializer_range", None) or getattr(subject.config, "init_std", None)
    std_tok, std_pos = float(tok.std()), float(used.std())
    if init is not None and abs(std_pos / init - 1) > 0.15:
        return ""  # noise, but not the init's noise: not evidence of a fresh initialisation
    tok_trained = abs(c_tok) > 8 * se_tok or (init is not None and abs(std_tok / init - 1) > 0.25)
    if not tok_trained:
        return ""
    init_text = f", std {std_pos:.3g} vs initializer_range {init}" if init else f", std {std_pos:.3g}"
    return (f"looks freshly initialised (adjacent-row cosine {c_adj:.3f} ± {se:.3f}, chance level{init_text}) "
            f"while the token embeddings look trained (row cosine {c_tok:.3f}, std {std_tok:.3g}): trained tables are "
            "smooth in position; was the table re-initialised or never trained?")


# ====================================================================== helpers
def _encoder_ids(subject: Subject, stack: str, ids: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Decoder probes of an encoder-decoder: a short fixed encoder input (at most 8 tokens), so a
    decoder probe at or past the context exercises the decoder's table, not the encoder's."""
    if not (subject.kind == "seq2seq" and stack == "decoder"):
        return None
    return ids[: min(8, len(ids))][None].expand(rows, -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom else float((a - b).norm())


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
