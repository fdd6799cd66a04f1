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

from typing import Any

from posdiag.checks import CheckSpec
from posdiag.checks._image_paths import with_padded_image_row
from posdiag.checks.batch.forward import DEFAULTS, LEFT_DEFAULTS
from posdiag.checks.batch.padded import SLIP_ROW, Measured, Probe, mask_ignored, plan
from posdiag.model.arbitration import arbitrate
from posdiag.model.introspect import takes_attention_mask
from posdiag.model.jitter import FLOOR_SOURCE
from posdiag.model.storage_mixing import length_dependent_pooling
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import FloorVerdict, agreement_tolerance, judge_agreement, noise_floor, powered

SPEC = CheckSpec(
    name="batch",
    title="Per-row positions in a padded batch",
    proves="each row of a padded batch gets its own positions and padding mask: a row alone equals itself in the batch",
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    pooling = length_dependent_pooling(subject.config)
    if pooling:
        return SPEC.result(Status.NA, f"{subject.family.name} mixes tokens by {pooling}: which tokens it keeps "
                           "depends on the padded length, so a padded row is not the same input as the row alone")
    result = combine_stacks(SPEC.name, [_run_stack(subject, options, stack) for stack in subject.stacks])
    return with_padded_image_row(result, subject, options.seed)  # multimodal RoPE: an image prompt's padded row


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    """One stack: plan the padded batch, measure it against each row alone, judge each row, report."""
    if not takes_attention_mask(subject, stack):  # padding would be mixed in like any token
        why = f" ({subject.family.mask_note})" if subject.family.mask_note else ""
        return SPEC.result(Status.NA, f"{type(subject.model).__name__} takes no attention mask{why}: padded rows "
                           "cannot be compared with the rows alone", details={"stack": stack})
    probe = plan(subject, options, stack)
    m = probe.measure()
    if m.non_finite:
        return SPEC.result(Status.FAIL, m.non_finite, details={"stack": stack, "row": m.non_finite_row})
    dtype = subject.dtype_name
    verdicts = {name: judge_agreement(err, m.floor, dtype) for name, err in m.errors.items()}
    finer: list[Measured] = []
    arbitration = arbitrate(subject, probe.measure, m.floor, verdicts, dtype,
                            lambda f: finer.append(f) or (f.floor, f.errors))
    verdicts.update(arbitration.verdicts)
    verdicts, power = powered(verdicts, m.slip_error, m.floor, dtype, bool(finer), "a padded row")
    details = _details(subject, probe, m, arbitration)
    if m.slip_error is not None:
        details["slip"] = {"error": m.slip_error, "ratio": m.slip_error / noise_floor(m.floor, dtype), "dtype": dtype,
                           "how": SLIP_ROW, "clause": power}
    lead = _ignored_mask_lead(subject, probe, verdicts, m.floor, details)
    if m.crashed:
        details["defaults_crashed"] = m.crashed
        return SPEC.result(Status.FAIL, f"rows with {DEFAULTS} crashed: {m.crashed} (a call transformers accepts for "
                           "this model)", details=details)
    return _report(stack, subject.kind, m, verdicts, arbitration, probe.notes, details, dtype, lead)


def _details(subject: Subject, probe: Probe, m: Measured, arbitration: Any) -> dict[str, Any]:
    dtype = subject.dtype_name
    n = probe.length - probe.pads
    return {
        "stack": probe.stack, "seq_len": probe.length, "padding": probe.pads, "valid_tokens": n,
        "floor_source": FLOOR_SOURCE if m.has_jitter else f"{dtype} machine epsilon (no token embedding found to "
                                                          "jitter)",
        "path": "2D padding mask + position_ids (model builds its mask)" if subject.is_hf else "explicit 4D mask",
        "error_per_row": m.errors, "first_diverging_token": m.first_token, "notes": probe.notes,
        **({"recurrent_mixers": probe.recurrent} if probe.recurrent else {}),
        "positions": ({"a": probe.refs["a"][1].tolist(), "b": probe.refs["b"][1].tolist()} if probe.takes
                      else "derived inside the model"),
        **arbitration.details,
    }


def _ignored_mask_lead(subject: Subject, probe: Probe, verdicts: dict[str, FloorVerdict], floor: float,
                       details: dict[str, Any]) -> str:
    """The lead of the summary when a failing left-padded row shows the forward ignores its attention_mask."""
    left_failing = [r for r in probe.rows if r.left and r.name in verdicts and verdicts[r.name].status is Status.FAIL]
    if not (left_failing and subject.is_hf
            and mask_ignored(subject, probe.stack, left_failing[0], probe.encoder_ids, floor)):
        return ""
    details["attention_mask_ignored"] = True
    return (f"{type(subject.model).__name__} ignores its attention_mask (a left-padded row gives the same output "
            "without it), so the pads run through the sequence mixers: ")


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
        bound = f"<= {tol:.2g}" if verdict.residual <= tol else f"over {tol:.2g} as run"
        summary = (f"every row equals itself run alone (max error {verdict.residual:.2g} {bound}"
                   f"{arbitration.clause(worst)}; {tested})")
        if details.get("slip", {}).get("clause"):
            summary += f"; {details['slip']['clause']}"
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
    return SPEC.result(status, summary, metrics, details, (table,))


# Only the defaults break under left padding while explicit ids are honoured: transformers documents this for
# absolute-position models (GPT-2's model doc: pad on the right; #18478, #3095) and generate() derives the ids from
# the mask, so it is the caller's contract (WARN, the fix stated). `generate`, `cache` and the explicit-id rows judge
# the library's own paths and stay FAIL.
DEFAULTS_WARN = ("left-padded rows without position_ids are numbered from the first padding column (documented for "
                 "absolute-position models): pass position_ids = attention_mask.cumsum(-1) - 1")
DEFAULTS_HINT = ("with explicit position_ids every row is right, so the model numbers a left-padded row from its first "
                 "padding column when called without them: pass position_ids = attention_mask.cumsum(-1) - 1, as "
                 "generate() does")


