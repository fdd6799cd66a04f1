"""The padded batch (plan) and its measurement against each row run alone (measure)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posdiag.checks.batch.forward import default_path, forward
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.introspect import attention_free, recurrent_mixers
from posdiag.model.jitter import jittered
from posdiag.model.kinds import PositionKind
from posdiag.model.probe import restart_positions
from posdiag.model.subject import Subject
from posdiag.model.tensors import per_token_change, relative_l2
from posdiag.options import RunOptions, probe_ids, probe_length
from posdiag.results import Status
from posdiag.verdict import agreement_tolerance, judge_agreement

# Position schemes that do not depend on where a row starts (or that read the padding mask; RoPE numbered from the
# first padding column is only shifted: RoFormer takes no position_ids). So is a model of recurrent mixers with no
# attention and no position mechanism (RWKV, Mamba): left padding moves no position there. "none found" alone is
# not enough: PEGASUS-X derives sinusoidal positions by arange that posdiag does not name.
_START_INVARIANT = ("alibi", "relative_bias", "rope")


def _positionless(subject: Subject) -> bool:
    return subject.position_kind == PositionKind.NONE and attention_free(subject.language_model)


def _pad_id(subject: Subject) -> int:
    pad = getattr(subject.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0


@dataclass(frozen=True)
class Padded:
    """One row of the padded batch."""

    name: str
    ids: torch.Tensor
    mask: torch.Tensor  # the 2D padding mask
    positions: torch.Tensor | None  # None: the family numbers the row itself
    ref: str  # the row alone it must equal: "a" or "b"
    left: bool  # padded on the left


@dataclass(frozen=True)
class Probe:
    """The padded batch of one stack, the rows alone it is compared with, and what was left out (notes)."""

    subject: Subject
    stack: str
    seed: int
    length: int
    pads: int
    pad: int
    rows: list[Padded]  # the last one: row 0 again, jittered (the floor)
    refs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "a"/"b" -> (ids, positions) of the row alone
    encoder_ids: torch.Tensor | None  # the fixed encoder input of a seq2seq decoder
    defaults_too: bool  # also run the model's defaults (no position_ids)
    takes: bool  # rows are given their own position_ids
    notes: list[str]
    recurrent: list[str]

    def measure(self) -> Measured:
        return measure(self)


def plan(subject: Subject, options: RunOptions, stack: str) -> Probe:
    length = probe_length(subject, options)
    pads = max(1, length // 4)
    n = length - pads
    two = probe_ids(subject, options, batch=2)
    a, b = two[0, :n], two[1, :n]
    takes = subject.family.takes_position_ids and subject.kind != "seq2seq"
    recurrent = recurrent_mixers(subject.language_model)
    notes: list[str] = []
    no_left = bool(recurrent) and not subject.is_hf
    if no_left:
        notes.append(f"left padding not tested: {subject.family.name} has recurrent sequence mixers "
                     f"({', '.join(recurrent)}) and posdiag's 4D mask hides padding from attention only, "
                     f"not from the recurrence")
    pa, pb = torch.arange(n), restart_positions(n)
    rows = _rows(subject, a, b, pads, takes, no_left, notes)
    refs = {"a": (a, pa)} | ({"b": (b, pb)} if takes else {})
    enc = probe_ids(subject, options, seed_offset=17)[0] if subject.kind == "seq2seq" and stack == "decoder" else None
    defaults_too = takes and subject.is_hf and subject.kind == "causal"
    return Probe(subject=subject, stack=stack, seed=options.seed, length=length, pads=pads, pad=_pad_id(subject),
                 rows=rows, refs=refs, encoder_ids=enc, defaults_too=defaults_too, takes=takes, notes=notes,
                 recurrent=recurrent)


def _rows(subject: Subject, a: torch.Tensor, b: torch.Tensor, pads: int, takes: bool, no_left: bool,
          notes: list[str]) -> list[Padded]:
    """Row a padded on each side, row b (restart positions) likewise where ids can be given, and the floor row.
    What cannot be tested is said in `notes`."""
    n, pad, dev = a.numel(), _pad_id(subject), subject.device

    def padded(x: torch.Tensor, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fill = torch.full((pads,), pad, dtype=x.dtype, device=dev)
        ones, zeros = torch.ones(n, dtype=torch.long, device=dev), torch.zeros(pads, dtype=torch.long, device=dev)
        return (torch.cat([fill, x]), torch.cat([zeros, ones])) if left else (torch.cat([x, fill]),
                                                                              torch.cat([ones, zeros]))

    def positions(base: torch.Tensor, left: bool) -> torch.Tensor:
        if left:
            return torch.cat([torch.zeros(pads, dtype=torch.long), base])
        return torch.cat([base, base[-1] + 1 + torch.arange(pads)])

    def row(name: str, x: torch.Tensor, base: torch.Tensor | None, ref: str, left: bool) -> Padded:
        ids, mask = padded(x, left)
        return Padded(name=name, ids=ids, mask=mask, positions=None if base is None else positions(base, left),
                       ref=ref, left=left)

    rows: list[Padded] = []
    for left in (False, True):
        if left and no_left:
            continue
        absolute = subject.position_kind not in _START_INVARIANT or subject.family.absolute_by_design
        if left and not takes and absolute and not _positionless(subject):
            notes.append(f"left padding not tested: {subject.family.name} numbers {subject.position_kind} positions "
                         f"by arange inside and takes no position_ids, so a left-padded row is not the same input"
                         + (f" ({subject.family.absolute_by_design})" if subject.family.absolute_by_design else ""))
            continue
        rows.append(row(f"a {'left' if left else 'right'}-padded", a, torch.arange(n) if takes else None, "a", left))
    if takes:
        for left in (False, True) if not no_left else (False,):
            rows.append(row(f"b {'left' if left else 'right'}-padded, restart positions", b, restart_positions(n),
                            "b", left))
    else:
        notes.append("rows with non-affine positions not tested: the family takes no position_ids")
    power = takes and not subject.as_stored_pass  # the stored-dtype pass: float32 measured the power
    slip = [replace(rows[0], name=SLIP_ROW, positions=_slipped(rows[0].positions, n))] if power else []
    return rows + slip + [replace(rows[0], name="a right-padded, jittered (noise floor)")]


SLIP_ROW = "a right-padded, one position early past its first token (power)"


def _slipped(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The run's power: row a's positions with every valid token after the first numbered one early (0, 0, 1, 2...):
    the smallest slip a relative scheme sees (a constant shift of the whole row is invisible to RoPE)."""
    slipped = positions.clone()
    slipped[1:n] -= 1
    return slipped


@dataclass
class Measured:
    errors: dict[str, float]  # row name -> ||in batch - alone|| / ||alone|| over its valid tokens
    first_token: dict[str, int | None]  # first valid token past the per-token tolerance
    floor: float
    has_jitter: bool
    non_finite: str = ""
    non_finite_row: str = ""
    crashed: str = ""  # the exception the model's own forward raised on its defaults path (no position_ids)
    slip_error: float | None = None  # the power row against row a alone (None: no position_ids to slip)


def measure(probe: Probe) -> Measured:
    """One forward of the padded batch (the last row jittered: the floor), one per reference row alone, and the
    model's defaults path; every row against itself alone."""
    subject, stack, rows, enc, pads = probe.subject, probe.stack, probe.rows, probe.encoder_ids, probe.pads
    dtype, dev, jitter_row = subject.dtype_name, subject.device, len(rows) - 1
    n = next(iter(probe.refs.values()))[0].numel()
    takes = rows[0].positions is not None
    batch_pos = torch.stack([r.positions for r in rows]) if takes else None
    with jittered(subject, stack, jitter_row, len(rows), probe.seed) as has_jitter:
        out = forward(subject, torch.stack([r.ids for r in rows]), torch.stack([r.mask for r in rows]), batch_pos,
                       stack, enc)
    alone = {key: forward(subject, ids[None], torch.ones(1, n, dtype=torch.long, device=dev),
                           pos[None] if takes else None, stack, enc)[0]
             for key, (ids, pos) in probe.refs.items()}
    compared = [(r.name, out[i, slice(pads, pads + n) if r.left else slice(0, n)], alone[r.ref])
                for i, r in enumerate(rows)]
    if broken := _non_finite(compared, alone, has_jitter):
        return broken
    floor = relative_l2(out[jitter_row, :n], out[0, :n]) if has_jitter else 0.0
    floor_tok = float(per_token_change(out[jitter_row, :n], out[0, :n]).max()) if has_jitter else 0.0
    compared = compared[:jitter_row]
    slip = compared.pop()[1:] if compared[-1][0] == SLIP_ROW else None
    crashed = ""
    if probe.defaults_too:
        try:
            compared += default_path(subject, probe.refs["a"][0], pads, probe.pad, stack)
        except Exception as exc:  # the model's own forward on a call transformers accepts: users hit it
            if raised_in_posdiag(exc):
                raise
            crashed = describe_error(exc)
    errors: dict[str, float] = {}
    first_token: dict[str, int | None] = {}
    for name, got, want in compared:
        errors[name] = relative_l2(got, want)
        bad = (per_token_change(got, want) > agreement_tolerance(floor_tok, dtype)).nonzero().flatten()
        first_token[name] = int(bad[0]) if bad.numel() else None
    return Measured(errors=errors, first_token=first_token, floor=floor, has_jitter=has_jitter, crashed=crashed,
                    slip_error=None if slip is None else relative_l2(*slip))


def _non_finite(compared: list[tuple[str, torch.Tensor, torch.Tensor]], alone: dict[str, torch.Tensor],
                has_jitter: bool) -> Measured | None:
    """A measurement naming the first row with a non-finite valid output, else None."""
    for i, (name, got, _) in enumerate(compared):
        if not bool(torch.isfinite(got).all()):
            tok = int((~torch.isfinite(got)).flatten(1).any(1).nonzero()[0])
            return Measured(errors={}, first_token={}, floor=0.0, has_jitter=has_jitter, non_finite_row=name,
                            non_finite=f"non-finite outputs in row '{name}' (batch row {i}) at valid token {tok}")
    for key, ref in alone.items():
        if not bool(torch.isfinite(ref).all()):
            return Measured(errors={}, first_token={}, floor=0.0, has_jitter=has_jitter, non_finite_row=f"{key} alone",
                            non_finite=f"non-finite outputs for row {key} run alone")
    return None


def mask_ignored(subject: Subject, stack: str, row: Padded, enc: torch.Tensor | None, floor: float) -> bool:
    """Whether a failing left-padded row comes out the same with its padding mask replaced by ones: the forward
    accepts attention_mask and does not read it (RWKV documents it as unused)."""
    pos = None if row.positions is None else row.positions[None]
    masked = forward(subject, row.ids[None], row.mask[None], pos, stack, enc)
    unmasked = forward(subject, row.ids[None], torch.ones_like(row.mask)[None], pos, stack, enc)
    return judge_agreement(relative_l2(unmasked, masked), floor, subject.dtype_name).status is Status.PASS


