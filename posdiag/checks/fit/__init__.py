"""fit — do the weights use positions the way the config says? The configuration against its likely mistakes.

Every other check compares two code paths of one model; a checkpoint whose config and weights disagree (rope_theta
lost in a port, q/k rows left in the other pairing layout, a scaling block that does not belong) runs
self-consistently and passes them all. What it cannot hide is its loss: trained weights predict best under the
configuration they were trained with. So `fit` scores what the model was trained to predict (natural text through
the checkpoint's tokenizer; without one, the second copy of repeated random sequences, predictable only through
positions) under the configuration as loaded and under each alternative (alternatives.py), all on the same
tokens, and FAILs when an alternative is better by a paired per-token test:

    d_t = loss_configured(t) - loss_alternative(t),   z = mean(d) / (sd(d) / sqrt(n)),
    FAIL when z >= Z_BOUND and mean(d) >= MIN_GAIN nats (judging.py).

Measured on SmolLM2-135M-Instruct (shipped prose; docs/checks.md has the table): healthy, every alternative is
worse (1023 tokens: nearest rope_theta x1/4, -0.049 nats, z = -4.8; x4 -0.063, z = -6.4); rope_theta 10000 in
config.json is beaten by x10 (+0.159 nats, z = 9.2); q/k rows interleaved by their de-interleaving (511 tokens:
+2.18 nats, z = 22.1); a spurious linear x4 scaling by its removal (+1.56 nats, z = 19.8). Copy accuracy at a
few distances is shown for the configuration and, on a FAIL, the decisive alternative (evidence, not the decision: the
θ-lost copy copies better than the healthy model at distances 64 and 256, worse only at 512).

SKIP (N/A for a model built in memory), cheaply, when the configured model predicts like an untrained one: no
better on its material than on a destroyed twin of it (the copy's source replaced by fresh tokens, the prose
shuffled), whatever its loss. The first row and its twin decide where they settle it (default-init models: one
forward), else the first rows and their twins, before the rest of the material or any alternative runs (Gemma's
scaled embeddings, large random weights).
Repeated sequences rank configurations only for a model trained to copy them: where the configuration copies too
little, each alternative is scored stage by stage while it can still copy enough (copying.py), and where none can,
the SKIP comes before the rest of their rows run (SmolLM2-135M without its tokenizer: 21 s instead of 51 on one thread).
Also SKIP when no candidate beats the targets' unigram entropy, and when the material cannot decide (undecided.py:
every candidate above the unigram entropy but not beyond noise, or an alternative gaining without reaching the
bound; the SKIP says how many targets would decide) — one sentence of --text is never a verdict. N/A by design:
encoders and encoder-decoders (no plain next-token stream to score), factory models without a transformers config
(nothing to vary), and an untrained model built in memory or saved with its weights as transformers initialises them
(fresh.py: nothing trained to fit). Alternatives are made in
memory and undone exactly (edits.py); the checkpoint on disk is never touched. Logits are reduced chunk by chunk
(posdiag.model.logits): a forward never holds full-vocabulary logits for more rows than one chunk.
"""

from __future__ import annotations

from typing import Any

from posdiag.checks import CheckSpec, Option
from posdiag.checks.fit import copying
from posdiag.checks.fit.alternatives import Alternative, NotApplicable, plan_alternatives
from posdiag.checks.fit.fresh import at_initialisation
from posdiag.checks.fit.judging import (
    Comparison,
    Scored,
    below_unigram,
    compare,
    copy_accuracy,
    not_its_task,
    score,
)
from posdiag.checks.fit.material import COPY_DISTANCES, TEXT_TOKENS, Material, copy_rows, plan_material
from posdiag.checks.fit.refine import refined
from posdiag.checks.fit.report import fail_summary, pass_summary, tables
from posdiag.checks.fit.screen import screened
from posdiag.checks.fit.undecided import predicts_no_text, undecided
from posdiag.model.logits import LOGIT_BUDGET
from posdiag.model.memory import forward_refusal
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status

SPEC = CheckSpec(
    name="fit",
    title="Weights fit the configured positions",
    proves="no likely alternative position configuration (RoPE base, pairing layout, scaling, table offset) "
           "predicts the model's training distribution better than the configuration as loaded",
    applies_to=("causal",),
    options={
        "text_tokens": Option(TEXT_TOKENS, "tokens of text scored: ~1000 give a paired z of 9 for a lost "
                                           "rope_theta on SmolLM2-135M, 500 only 5 (the bound)", (int,)),
        "copy_distances": Option(COPY_DISTANCES, "copy accuracy shown at these distances (evidence, not the "
                                                 "decision)", (list, tuple)),
    },
    baseline={"margin": "higher"},
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    why = _not_applicable(subject)
    if why:  # by design: nothing fit could score, whatever the weights (never fails a gate unless required)
        return SPEC.result(Status.NA, why)
    material = plan_material(subject, options, options.for_check("fit"))
    if material is None:
        return SPEC.result(Status.SKIP, f"the declared context ({subject.max_positions} tokens) is too short "
                           "for a repeated sequence")
    width = int(material.ids.shape[1])
    too_big = forward_refusal(subject, "scoring the material", 1, width, hidden_states=False,
                              logits_rows=min(width, max(1, LOGIT_BUDGET // (4 * max(1, subject.vocab_size or 1)))))
    if too_big:  # planned before it runs: a forward memory cannot hold is not started
        return SPEC.result(Status.SKIP, f"{too_big} ([checks.fit] text_tokens sets a shorter row)")
    try:
        configured, screen, why = screened(subject, material, options.seed)
    except (ValueError, RuntimeError, TypeError) as exc:  # the model refuses a plain scoring forward: nothing to score
        return SPEC.result(Status.SKIP, f"cannot score the model's predictions ({type(exc).__name__}: "
                           f"{str(exc)[:160]})")
    if why:
        built = screen.untrained and not subject.load_info.files
        fresh = at_initialisation(subject) if screen.untrained and not built else None
        return SPEC.result(Status.NA if built or fresh else Status.SKIP,
                           why + (_BUILT if built else f"; {fresh}: no training to fit" if fresh else ""),
                           {"loss": configured.loss, "targets": configured.losses.size,
                            "context_gain": screen.gain, "context_gain_error": screen.spread})
    alternatives, notes = plan_alternatives(subject, int(material.ids.shape[1]))
    if not alternatives:
        return SPEC.result(Status.SKIP, f"no alternative configuration to score against ({subject.position_kind}"
                           f" positions{'; ' + '; '.join(notes) if notes else ''})")
    comparisons, skipped, stopped = _measure(subject, material, configured, alternatives)
    if stopped:  # repeated sequences no candidate copies, found before every alternative scored every row
        return SPEC.result(Status.SKIP, copying.none_copies(material, configured, list(stopped.values())),
                           {"loss": configured.loss, "unigram": material.unigram, "targets": material.count},
                           {"source": material.source, "notes": notes + skipped,
                            "candidates": [{"label": label, "targets": s.hits.size, "copied": copying.copied(s)}
                                           for label, s in stopped.items()]})
    result = _judge(subject, options, material, configured, comparisons, notes + skipped)
    result.metrics.update(context_gain=screen.gain, context_gain_error=screen.spread)  # the screen's, on every verdict
    return result


# A model built in memory (a factory, an nn.Module: no weights loaded) that the screen's equivalence test finds
# untrained is the fresh initialisation a unit test builds: no training to fit, by construction (N/A). The same
# measurement on a checkpoint is N/A only where its weights witness it too (fresh.at_initialisation: every norm weight
# and bias constant, every matrix at the init's spread), else a SKIP: a checkpoint is meant to carry training, and
# weights that do not use their context may be a trained model broken past use, which `--fail-on skip` must catch.
_BUILT = "; built in memory with no weights loaded, it carries no training for a configuration to fit"


def _not_applicable(subject: Subject) -> str:
    """Why fit cannot apply to this model by design, or "": it scores the next-token predictions of a causal LM
    against the transformers config it was loaded with."""
    if subject.kind == "encoder":
        return ("a bidirectional encoder predicts no next token: fit scores left-to-right predictions under each "
                "configuration, which a masked LM does not make (a masked-token pseudo-likelihood would be another "
                "check)")
    if subject.kind != "causal":
        return (f"an encoder-decoder ({subject.kind}) predicts its output from an input (corrupted spans, a source "
                "sentence): there is no plain text stream to score under each configuration")
    if not subject.is_hf:
        return "a factory model without a transformers config: no configuration to vary"
    return ""


def _measure(subject: Subject, material: Material, configured: Scored,
             alternatives: list[Alternative]) -> tuple[list[Comparison], list[str], dict[str, Scored]]:
    """Each alternative applied in memory, scored on the same tokens, undone. On repeated sequences the configuration
    does not copy, stage by stage while the alternative can still copy enough for them to rank anything (copying.py):
    where none can, the third value holds each one's scores so far, and the rows left are never run; otherwise every
    alternative stopped early scores its remaining rows."""
    bounds = copying.stage_rows(material) if copying.staged(material, configured) else [int(material.ids.shape[0])]
    scored, skipped = [], []
    for alt in alternatives:
        done, rows = None, 0
        for stop in bounds:
            done = _joined(done, _scored(subject, material.rows(rows, stop), alt, skipped))
            rows = stop if done is not None else rows
            if done is None or copying.out_of_reach(done, material.count):
                break
        if done is not None:
            scored.append((alt, done, rows))
    if len(bounds) > 1 and scored and all(copying.out_of_reach(s, material.count) for _, s, _ in scored):
        return [], skipped, {alt.label: done for alt, done, _ in scored}
    comparisons = []
    for alt, done, rows in scored:
        if rows < material.ids.shape[0]:  # stopped early: its remaining rows (independent of the ones scored)
            done = _joined(done, _scored(subject, material.rows(rows), alt, skipped))
        if done is not None:
            comparisons.append(compare(alt, configured, done))
    return comparisons, skipped, {}


def _scored(subject: Subject, material: Material, alt: Alternative, skipped: list[str]) -> Scored | None:
    """MATERIAL scored under ALT, or None with the reason added to SKIPPED."""
    try:
        with alt.apply(subject):
            return score(subject, material, alt.label, alt.shift)
    except NotApplicable as exc:
        skipped.append(f"{alt.label} not tried: {exc}")
    except Exception as exc:  # the model cannot run a configuration it was not built for: not a verdict
        skipped.append(f"{alt.label} not tried: the model raises under it ({type(exc).__name__}: "
                       f"{str(exc)[:100]})")
    return None


def _joined(before: Scored | None, after: Scored | None) -> Scored | None:
    """Scores of earlier rows followed by later ones; None where the later ones could not be scored."""
    if after is None:
        return None
    return after if before is None else before.joined(after)


def _judge(subject: Subject, options: RunOptions, material: Material, configured: Scored,
           comparisons: list[Comparison], notes: list[str]) -> CheckResult:
    if not comparisons:
        return SPEC.result(Status.SKIP, f"no alternative could be applied: {'; '.join(notes)}")
    candidates = [configured] + [c.scored for c in comparisons]
    best = min(candidates, key=lambda s: s.loss)
    broken, cannot_tell = predicts_no_text(candidates, material)
    if broken:  # the screen found a trained model: no configuration tried makes it predict text
        return SPEC.result(Status.FAIL, broken, {"loss": configured.loss, "best_loss": best.loss,
                                                 "unigram": material.unigram},
                           {"source": material.source, "notes": notes, "candidates": _candidates(comparisons)},
                           tables(configured, comparisons, {}, max(comparisons, key=lambda c: c.gain)))
    why = cannot_tell or below_unigram(best, material.unigram) or not_its_task(best, material)
    if why:
        return SPEC.result(Status.SKIP, why, {"loss": configured.loss, "unigram": material.unigram,
                                              "targets": material.count},
                           {"source": material.source, "notes": notes, "candidates": _candidates(comparisons)})
    winners = [c for c in comparisons if c.beats]
    why = "" if winners else undecided(comparisons, material)
    if why:  # a gain the material could not confirm: neither a PASS nor a FAIL
        return SPEC.result(Status.SKIP, why, {"loss": configured.loss, "targets": material.count},
                           {"source": material.source, "notes": notes, "candidates": _candidates(comparisons)},
                           tables(configured, comparisons, {}, max(comparisons, key=lambda c: c.z)))
    decisive = max(winners, key=lambda c: c.gain) if winners else max(comparisons, key=lambda c: c.z)
    decisive, searched = refined(subject, material, configured, comparisons, decisive)
    copies = _copy_evidence(subject, options, material, configured, decisive)
    metrics = {**_metrics(material, configured, decisive, copies), "line_search_forwards": searched}
    details: dict[str, Any] = {"source": material.source, "notes": notes, "candidates": _candidates(comparisons)}
    table = tables(configured, comparisons, copies, decisive)
    if winners:
        return SPEC.result(Status.FAIL, fail_summary(material, configured, decisive, copies),
                           metrics, details, table)
    return SPEC.result(Status.PASS, pass_summary(material, configured, decisive, len(comparisons), notes),
                       metrics, details, table)


def _candidates(comparisons: list[Comparison]) -> list[dict[str, Any]]:
    return [{"label": c.alternative.label, "loss": c.scored.loss, "gain": c.gain, "z": c.z, "beats": c.beats}
            for c in comparisons]


def _copy_evidence(subject: Subject, options: RunOptions, material: Material, configured: Scored,
                   decisive: Comparison) -> dict[str, dict[int, float]]:
    """Copy accuracy by distance for the configuration and the decisive alternative: read off the material's own
    forwards for repeated sequences; on copy rows of their own for text, the alternative's only where it beats the
    configuration (the evidence of a FAIL: a PASS's nearest alternative would cost a forward per distance to show
    what its loss already says, 17% of `fit` on SmolLM2)."""
    if material.distances:
        return {"configured": copy_accuracy(configured, material.distances, material),
                decisive.alternative.label: copy_accuracy(decisive.scored, material.distances, material)}
    distances = SPEC.setting(options, "copy_distances")
    groups = copy_rows(subject, options.seed, tuple(int(n) for n in distances))
    alternative = decisive.alternative if decisive.beats else None
    out: dict[str, dict[int, float]] = {"configured": {}, **({alternative.label: {}} if alternative else {})}
    for group in groups:
        out["configured"].update(copy_accuracy(score(subject, group, "configured"), group.distances, group))
        if alternative is not None:
            with alternative.apply(subject):
                scored = score(subject, group, alternative.label, alternative.shift)
            out[alternative.label].update(copy_accuracy(scored, group.distances, group))
    return out


def _metrics(material: Material, configured: Scored, decisive: Comparison,
             copies: dict[str, dict[int, float]]) -> dict[str, Any]:
    return {"loss": configured.loss, "targets": material.count, "unigram": material.unigram,
            "nearest": decisive.alternative.label, "nearest_loss": decisive.scored.loss,
            "margin": -decisive.gain, "z": decisive.z,
            "copy_accuracy": {k: {str(n): a for n, a in v.items()} for k, v in copies.items()}}
