"""batch — does each row of a padded batch get its own positions (and its own padding mask)?

A row run alone must equal the same row inside a batch, over its valid (non-padding) queries:
f_batch(x)[row, valid] = f_alone(x_row). Rows of the batch (length T, k = T/4 padding tokens):

  0  a, right-padded           positions 0..n-1 (then continuing over the pads)
  1  a, left-padded            positions 0 on the pads, then 0..n-1
  2  b, right-padded           *restart* positions 0..n/2-1, 0..n-n/2-1 (packed-like)
  3  b, left-padded            pads, then the same restart positions
  4  row 0 again, token embeddings jittered by ~1 ulp: the noise floor (see `positions`)

Row b's positions differ from row a's non-affinely on purpose: RoPE is blind to a constant
per-row offset, so a bug that hands every row row 0's position ids is only visible on a row whose
positions are not a shift of row 0's (BUGS.md A, unsloth #3699). Left padding catches a path that
drops the padding mask (valid queries then see the pad keys) and positions not started at the
first real token (learned tables). error = ||f_batch[row, valid] − f_alone|| / ||f_alone||,
judged as agreement against the floor; NaN in a valid position is a FAIL naming the row.

Transformers models run the path users run: a 2D padding attention_mask and explicit position_ids
(the model builds its own 4D mask); `module:factory` models get posdiag's additive 4D mask.
Forward passes: one for the batch, one per reference row run alone (2; 1 where rows cannot be
given their own positions).

Families that derive positions inside (position_ids "ignored"): relative schemes (ALiBi, T5
buckets) are blind to where the row starts, and Bloom/Falcon derive ALiBi from the mask, so the
left-padded row is still exact; absolute schemes numbered by arange (BART, Marian) cannot be
left-padded at all, so only right padding is tested there (said in the report). Rows with
non-affine positions need position_ids: not run for those families (said in the report).
Encoder-decoders: each stack; the decoder with one fixed, unpadded encoder input. A model whose forward takes no
attention mask (FNet: its Fourier transform mixes every token, padding included) is skipped, saying so.

Recurrent / linear-attention / convolutional mixers (posdiag.model.introspect) need no permutation here: a row alone
must still equal itself in the batch, and transformers hands them the same 2D padding mask. A
`module:factory` model gets posdiag's 4D mask, which transformers' recurrent layers ignore (padding is not
masked in the recurrence), so there left padding is not tested (said in the report): right padding comes
after every valid token, and a causal recurrence cannot see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posdiag.checks import CheckSpec
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.arbitration import arbitrate
from posdiag.model.introspect import attention_free, recurrent_mixers, takes_attention_mask
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.probe import Row, restart_positions, run_rows
from posdiag.model.storage_mixing import length_dependent_pooling
from posdiag.model.subject import Subject
from posdiag.model.tensors import per_token_change, relative_l2, token_states
from posdiag.options import RunOptions, probe_ids, probe_length
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import agreement_tolerance, judge_agreement

SPEC = CheckSpec(
    name="batch",
    title="Per-row positions in a padded batch",
    proves="each row of a padded batch gets its own positions and padding mask: a row alone equals itself in the batch",
)


# Position schemes that do not depend on where a row starts (or that read the padding mask; RoPE numbered from the
# first padding column is only shifted: RoFormer takes no position_ids). So is a model of recurrent mixers with no
# attention and no position mechanism (RWKV, Mamba): left padding moves no position there. "none found" alone is
# not enough: PEGASUS-X derives sinusoidal positions by arange that posdiag does not name.
_START_INVARIANT = ("alibi", "relative_bias", "rope")


def run(subject: Subject, options: RunOptions) -> CheckResult:
    pooling = length_dependent_pooling(subject.config)
    if pooling:
        return CheckResult("batch", Status.NA, f"{subject.family.name} mixes tokens by {pooling}: which tokens "
                           "it keeps depends on the padded length, so a padded row is not the same input as the row "
                           "alone")
    return combine_stacks("batch", [_run_stack(subject, options, stack) for stack in subject.stacks])


def _positionless(subject: Subject) -> bool:
    return subject.position_kind == "none found" and attention_free(subject.language_model)


def _pad_id(subject: Subject) -> int:
    pad = getattr(subject.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    if not takes_attention_mask(subject, stack):  # padding would be mixed in like any token
        why = f" ({subject.family.mask_note})" if subject.family.mask_note else ""
        return CheckResult("batch", Status.NA, f"{type(subject.model).__name__} takes no attention mask{why}: padded "
                           "rows cannot be compared with the rows alone", details={"stack": stack})
    dtype = subject.dtype_name
    length = probe_length(subject, options)
    pads = max(1, length // 4)
    n = length - pads
    two = probe_ids(subject, options, batch=2)
    a, b = two[0, :n], two[1, :n]
    pad = _pad_id(subject)
    dev = subject.device
    takes = subject.family.takes_position_ids and subject.kind != "seq2seq"
    notes: list[str] = []
    recurrent = recurrent_mixers(subject.language_model)
    no_left = recurrent and not subject.is_hf
    if no_left:
        notes.append(f"left padding not tested: {subject.family.name} has recurrent sequence mixers "
                     f"({', '.join(recurrent)}) and posdiag's 4D mask hides padding from attention only, "
                     f"not from the recurrence")

    def padded(x: torch.Tensor, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fill = torch.full((pads,), pad, dtype=x.dtype, device=dev)
        ones, zeros = torch.ones(n, dtype=torch.long, device=dev), torch.zeros(pads, dtype=torch.long, device=dev)
        return (torch.cat([fill, x]), torch.cat([zeros, ones])) if left else (torch.cat([x, fill]),
                                                                              torch.cat([ones, zeros]))

    def positions(base: torch.Tensor, left: bool) -> torch.Tensor:
        if left:
            return torch.cat([torch.zeros(pads, dtype=torch.long), base])
        return torch.cat([base, base[-1] + 1 + torch.arange(pads)])

    pa = torch.arange(n)
    pb = restart_positions(n)
    # (name, ids, 2D mask, positions or None, reference key, left-padded?)
    rows: list[tuple[str, torch.Tensor, torch.Tensor, Any, str, bool]] = []
    for left in (False, True):
        if left and no_left:
            continue
        absolute = subject.position_kind not in _START_INVARIANT or subject.family.absolute_by_design
        if left and not takes and absolute and not _positionless(subject):
            notes.append(f"left padding not tested: {subject.family.name} numbers {subject.position_kind} positions "
                         f"by arange inside and takes no position_ids, so a left-padded row is not the same input"
                         + (f" ({subject.family.absolute_by_design})" if subject.family.absolute_by_design else ""))
            continue
        ids, mask = padded(a, left)
        rows.append((f"a {'left' if left else 'right'}-padded", ids, mask,
                     positions(pa, left) if takes else None, "a", left))
    if takes:
        for left in (False, True) if not no_left else (False,):
            ids, mask = padded(b, left)
            rows.append((f"b {'left' if left else 'right'}-padded, restart positions", ids, mask,
                         positions(pb, left), "b", left))
    else:
        notes.append("rows with non-affine positions not tested: the family takes no position_ids")
    rows.append(("a right-padded, jittered (noise floor)",) + rows[0][1:])
    refs = {"a": (a, pa)} | ({"b": (b, pb)} if takes else {})
    enc = probe_ids(subject, options, seed_offset=17)[0] if subject.kind == "seq2seq" and stack == "decoder" else None
    default_path = takes and subject.is_hf and subject.kind == "causal"

    def measure() -> Measured:
        return _measure(subject, stack, rows, refs, enc, options.seed, pads, pad, default_path)

    m = measure()
    if m.non_finite:
        return CheckResult("batch", Status.FAIL, m.non_finite, details={"stack": stack, "row": m.non_finite_row})
    verdicts = {name: judge_agreement(err, m.floor, dtype) for name, err in m.errors.items()}
    arbitration = arbitrate(subject, measure, m.floor, verdicts, dtype, lambda f: (f.floor, f.errors))
    verdicts.update(arbitration.verdicts)
    details: dict = {
        "stack": stack, "seq_len": length, "padding": pads, "valid_tokens": n,
        "floor_source": FLOOR_SOURCE if m.has_jitter else f"{dtype} machine epsilon (no token embedding found to "
                                                          "jitter)",
        "path": "2D padding mask + position_ids (model builds its mask)" if subject.is_hf else "explicit 4D mask",
        "error_per_row": m.errors, "first_diverging_token": m.first_token, "notes": notes,
        **({"recurrent_mixers": recurrent} if recurrent else {}),
        "positions": {"a": pa.tolist(), "b": pb.tolist()} if takes else "derived inside the model",
        **arbitration.details,
    }
    left_failing = [r for r in rows if r[5] and r[0] in verdicts and verdicts[r[0]].status is Status.FAIL]
    lead = ""
    if left_failing and subject.is_hf and _mask_ignored(subject, stack, left_failing[0], enc, m.floor):
        details["attention_mask_ignored"] = True
        lead = (f"{type(subject.model).__name__} ignores its attention_mask (a left-padded row gives the same output "
                "without it), so the pads run through the sequence mixers: ")
    if m.crashed:
        details["defaults_crashed"] = m.crashed
        return CheckResult("batch", Status.FAIL, f"rows with {DEFAULTS} crashed: {m.crashed} (a call transformers "
                           "accepts for this model)", details=details)
    return _report(stack, subject.kind, m, verdicts, arbitration, notes, details, dtype, lead)


def _mask_ignored(subject: Subject, stack: str, row: tuple, enc: torch.Tensor | None, floor: float) -> bool:
    """Whether a failing left-padded row comes out the same with its padding mask replaced by ones: the forward
    accepts attention_mask and does not read it (RWKV documents it as unused)."""
    _name, ids, mask, pos, _key, _left = row
    pos = None if pos is None else pos[None]
    masked = _forward(subject, ids[None], mask[None], pos, stack, enc)
    unmasked = _forward(subject, ids[None], torch.ones_like(mask)[None], pos, stack, enc)
    return judge_agreement(relative_l2(unmasked, masked), floor, subject.dtype_name).status is Status.PASS


@dataclass
class Measured:
    errors: dict[str, float]  # row name -> ||in batch - alone|| / ||alone|| over its valid tokens
    first_token: dict[str, int | None]  # first valid token past the per-token tolerance
    floor: float
    has_jitter: bool
    non_finite: str = ""
    non_finite_row: str = ""
    crashed: str = ""  # the exception the model's own forward raised on its defaults path (no position_ids)


def _measure(subject: Subject, stack: str, rows: list, refs: dict, enc: torch.Tensor | None, seed: int, pads: int,
             pad: int, default_path: bool) -> Measured:
    """One forward of the padded batch (the last row jittered: the floor), one per reference row alone, and the
    model's defaults path; every row against itself alone."""
    dtype, dev, jitter_row = subject.dtype_name, subject.device, len(rows) - 1
    n = next(iter(refs.values()))[0].numel()
    takes = rows[0][3] is not None
    batch_pos = torch.stack([r[3] for r in rows]) if takes else None
    with jittered(subject, stack, jitter_row, len(rows), seed) as has_jitter:
        out = _forward(subject, torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows]), batch_pos,
                       stack, enc)
    alone = {key: _forward(subject, ids[None], torch.ones(1, n, dtype=torch.long, device=dev),
                           pos[None] if takes else None, stack, enc)[0]
             for key, (ids, pos) in refs.items()}
    compared = [(name, out[i, slice(pads, pads + n) if left else slice(0, n)], alone[key])
                for i, (name, _i, _m, _p, key, left) in enumerate(rows)]
    for i, (name, got, _) in enumerate(compared):
        if not bool(torch.isfinite(got).all()):
            tok = int((~torch.isfinite(got)).flatten(1).any(1).nonzero()[0])
            return Measured({}, {}, 0.0, has_jitter,
                            f"non-finite outputs in row '{name}' (batch row {i}) at valid token {tok}", name)
    for key, ref in alone.items():
        if not bool(torch.isfinite(ref).all()):
            return Measured({}, {}, 0.0, has_jitter, f"non-finite outputs for row {key} run alone", f"{key} alone")
    floor = relative_l2(out[jitter_row, :n], out[0, :n]) if has_jitter else 0.0
    floor_tok = float(per_token_change(out[jitter_row, :n], out[0, :n]).max()) if has_jitter else 0.0
    compared = compared[:jitter_row]
    crashed = ""
    if default_path:
        try:
            compared += _default_path(subject, refs["a"][0], pads, pad, stack)
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
    return Measured(errors, first_token, floor, has_jitter, crashed=crashed)


def _report(stack: str, kind: str, m: Measured, verdicts: dict, arbitration: Any, notes: list[str], details: dict,
            dtype: str, lead: str = "") -> CheckResult:
    errors, first_token = m.errors, m.first_token
    failing = [r for r in errors if verdicts[r].status is Status.FAIL]
    worst = failing[0] if failing else max(errors, key=errors.get)
    verdict = verdicts[worst]
    status = Status.worst([v.status for v in verdicts.values()])
    tol = agreement_tolerance(m.floor, dtype)
    metrics = {"error": verdict.residual, "noise_floor": verdict.noise_floor, "ratio": verdict.ratio, "tolerance": tol,
               **arbitration.metrics}
    tested = f"{len(errors)} rows: {', '.join(errors)}"
    if status is Status.PASS:
        summary = (f"every row equals itself run alone (max error {verdict.residual:.2g} <= {tol:.2g}"
                   f"{arbitration.clause(worst)}; {tested})")
        if notes:
            summary += f"; {notes[0].split(':')[0]}"
    elif status is Status.WARN:
        summary = f"row '{worst}': {verdict.reason}"
    elif failing == [LEFT_DEFAULTS] and not lead:  # the caller's contract, not a library path: WARN with the fix
        status = Status.WARN
        details["default_path"] = DEFAULTS_HINT
        summary = (f"{DEFAULTS_WARN} (error {verdict.residual:.3g} = {verdict.ratio:.3g}x floor "
                   f"{verdict.noise_floor:.2g}{arbitration.clause(worst)}; every row given position_ids equals itself "
                   "alone)")
    else:
        tok = first_token[worst]
        summary = (f"{lead}row '{worst}' differs from the same row alone: error {verdict.residual:.3g} = "
                   f"{verdict.ratio:.3g}x "
                   f"floor {verdict.noise_floor:.2g}" + (f", from valid token {tok}" if tok is not None else "")
                   + f"{arbitration.clause(worst)}; failing rows: {', '.join(failing)}")
        if all(DEFAULTS in r for r in failing):
            details["default_path"] = DEFAULTS_HINT
            summary += f"; {DEFAULTS_HINT}"
    title = f"row alone vs in a padded batch ({stack})" if kind == "seq2seq" else "row alone vs in a padded batch"
    table = Table(title, ("row", "error", "ratio to floor", "first diverging token"),
                  tuple((r, f"{e:.3e}", f"{e / verdict.noise_floor:.3g}",
                         "-" if first_token[r] is None else str(first_token[r])) for r, e in errors.items()))
    return CheckResult("batch", status, summary, metrics, details, (table,))


DEFAULTS = "no position_ids (the model's defaults)"
LEFT_DEFAULTS = f"a left-padded, {DEFAULTS}"
# Only the defaults break under left padding while explicit ids are honoured: transformers documents this for
# absolute-position models (GPT-2's model doc: pad on the right; #18478, #3095) and generate() derives the ids from
# the mask, so it is the caller's contract (WARN, the fix stated). `generate`, `cache` and the explicit-id rows judge
# the library's own paths and stay FAIL.
DEFAULTS_WARN = ("left-padded rows without position_ids are numbered from the first padding column (documented for "
                 "absolute-position models): pass position_ids = attention_mask.cumsum(-1) - 1")
DEFAULTS_HINT = ("with explicit position_ids every row is right, so the model numbers a left-padded row from its first "
                 "padding column when called without them: pass position_ids = attention_mask.cumsum(-1) - 1, as "
                 "generate() does")


def _default_path(subject: Subject, a: torch.Tensor, pads: int, pad: int,
                  stack: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Row a padded on either side with a 2D mask and no position_ids (left-padded scoring, nnsight #672,
    transformers #3021), against row a alone without position_ids: the path users take without ids."""
    dev, n = subject.device, a.numel()
    fill = torch.full((pads,), pad, dtype=a.dtype, device=dev)
    ones, zeros = torch.ones(n, dtype=torch.long, device=dev), torch.zeros(pads, dtype=torch.long, device=dev)
    ids = torch.stack([torch.cat([a, fill]), torch.cat([fill, a])])
    mask = torch.stack([torch.cat([ones, zeros]), torch.cat([zeros, ones])])
    out = _forward(subject, ids, mask, None, stack, None)
    alone = _forward(subject, a[None], ones[None], None, stack, None)[0]
    return [(f"a right-padded, {DEFAULTS}", out[0, :n], alone), (LEFT_DEFAULTS, out[1, pads:], alone)]


def _forward(subject: Subject, ids: torch.Tensor, mask2d: torch.Tensor, positions: torch.Tensor | None,
             stack: str, encoder_ids: torch.Tensor | None) -> torch.Tensor:
    """Final hidden states [B, T, D] of the rows, on the path a user takes (one forward per chunk)."""
    if not subject.is_hf:
        rows = [Row(ids[i], positions=None if positions is None else positions[i], valid=mask2d[i].bool())
                for i in range(ids.shape[0])]
        return run_rows(subject, rows, stack=stack).final
    step = subject.options.max_batch or ids.shape[0]
    parts = []
    for start in range(0, ids.shape[0], step):
        sl = slice(start, start + step)
        parts.append(_forward_hf(subject, ids[sl], mask2d[sl], None if positions is None else positions[sl],
                                 stack, encoder_ids))
    return torch.cat(parts)


def _forward_hf(subject: Subject, ids: torch.Tensor, mask2d: torch.Tensor, positions: torch.Tensor | None,
                stack: str, encoder_ids: torch.Tensor | None) -> torch.Tensor:
    subject.forward_count += 1
    model = subject.model
    ids, mask2d = ids.to(subject.device), mask2d.to(subject.device)
    with torch.inference_mode():
        if subject.kind == "seq2seq":
            if stack == "encoder":
                out = model.get_encoder()(input_ids=ids, attention_mask=mask2d, output_hidden_states=True,
                                          return_dict=True)
                return token_states(out.hidden_states or (out.last_hidden_state,), ids.shape)[-1]
            enc = encoder_ids[None].expand(ids.shape[0], -1).to(subject.device)
            out = model(input_ids=enc, attention_mask=torch.ones_like(enc), decoder_input_ids=ids,
                        decoder_attention_mask=mask2d, output_hidden_states=True, use_cache=False, return_dict=True)
            return token_states(out.decoder_hidden_states[-1:], ids.shape)[-1]
        kwargs: dict[str, Any] = {}
        if positions is not None:
            kwargs["position_ids"] = subject.position_ids_for(positions.to(subject.device))
        if subject.kind != "encoder":
            kwargs["use_cache"] = False
        if subject.takes_logits_to_keep:  # only hidden states are compared: no [B, T, vocab] logits
            kwargs["logits_to_keep"] = 1
        out = model(input_ids=ids, attention_mask=mask2d, output_hidden_states=True, return_dict=True, **kwargs)
        hidden = out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,)
        return token_states(hidden[-1:], ids.shape)[-1]
