"""When `fit`'s material cannot decide: a verdict needs its evidence beyond the noise of the targets scored.

Two findings rest on per-target differences and so on how many targets were scored (a --text of one sentence gives
~40; the shipped prose 1023):
- "does not predict text": every candidate predicts the text worse than the targets' own unigram frequencies. Each
  candidate's excess e_t = loss(t) + log p_unigram(t) (mean: its loss minus the unigram entropy) must lie SETTLED
  standard errors above 0, the bound at which the screen already found the model trained; every candidate, since
  the FAIL says none predicts text (an intersection-union test: the weakest candidate's z decides). A healthy
  character-level model on one English sentence sits 0.6 nats above its unigram entropy at z = 1.2 (a wide spread
  of per-character losses: sd ~3 nats); SmolLM2 with its q/k rows permuted by a wrong converter 0.48 at z = 3.2 over
  255 tokens and 0.35 at z = 5.0 over 1023.
- an alternative that gains at least MIN_GAIN nats a target over the configuration but stays under Z_BOUND: the
  point estimate says the weights fit it better, the spread cannot confirm it; a PASS would claim what the material
  did not show (the window-text fixture with its window dropped, 99 characters of text: +0.5 nats at z = 4.4).
Either is a SKIP that says how much material would decide: z grows as the square root of the targets, so at the
measured gain and spread about n (bound / z)^2 targets reach the bound.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from posdiag.checks.fit.judging import MIN_GAIN, Z_BOUND, Comparison, Scored
from posdiag.checks.fit.material import Material
from posdiag.checks.fit.screen import SETTLED


def excess_z(scored: Scored, material: Material) -> tuple[float, float]:
    """The candidate's mean excess over the targets' in-sample unigram surprisal (nats) and its paired z."""
    targets = scored.targets.tolist() if scored.targets is not None else []
    if len(targets) != scored.losses.size or len(targets) < 2:
        return float(scored.loss - material.unigram), 0.0
    counts = Counter(targets)
    surprisal = np.array([-math.log(counts[t] / len(targets)) for t in targets])
    d = scored.losses - surprisal
    sd = float(d.std(ddof=1))
    mean = float(d.mean())
    z = mean / (sd / math.sqrt(d.size)) if sd > 0 else math.copysign(math.inf, mean) if mean else 0.0
    return mean, z


def predicts_no_text(candidates: list[Scored], material: Material) -> tuple[str, str]:
    """(why this trained model is broken under every configuration tried, why the material cannot tell): on text,
    every candidate's loss lies beyond noise above the targets' unigram entropy, or it lies above without reaching
    the bound. ("", "") when the best candidate is below the unigram entropy. Repeated sequences are not text: a
    model that does not copy them is judged by judging.not_its_task."""
    best = min(candidates, key=lambda s: s.loss)
    if material.distances or not best.loss > material.unigram:
        return "", ""
    weakest, (gain, z) = min(((c, excess_z(c, material)) for c in candidates), key=lambda item: item[1][1])
    if z >= SETTLED:
        return (f"this checkpoint does not predict text under any configuration tried: best loss {best.loss:.2f} "
                f"nats ({best.label}), above the targets' own unigram entropy {material.unigram:.2f} (every "
                f"candidate beyond noise: z >= {z:.1f} over {material.count} tokens), while it gains from context "
                "like a trained model; its weights or their layout are broken in a way no alternative undoes"), ""
    return "", (f"cannot tell from {material.count} tokens ({_source(material)}) whether this checkpoint predicts "
                f"text: its best loss {best.loss:.2f} nats ({best.label}) lies above the targets' own unigram "
                f"entropy {material.unigram:.2f}, the weakest candidate ({weakest.label}) by {gain:+.2f} nats at "
                f"z = {z:.1f}, short of the {SETTLED:g} a FAIL needs for every candidate; "
                f"{needed(material, z, SETTLED)}")


def undecided(comparisons: list[Comparison], material: Material) -> str:
    """Why the material cannot decide between the configuration and an alternative that gains at least MIN_GAIN
    without reaching Z_BOUND, or "" (the strongest such alternative is named)."""
    open_ = [c for c in comparisons if not c.beats and c.gain >= MIN_GAIN and 0 < c.z < Z_BOUND]
    if not open_:
        return ""
    strongest = max(open_, key=lambda c: c.z)
    return (f"cannot decide on {material.count} {_unit(material)} ({_source(material)}): "
            f"{strongest.alternative.label} gains {strongest.gain:+.3f} nats a target over the configuration at "
            f"z = {strongest.z:.1f} (FAIL needs z >= {Z_BOUND:g} and a gain >= {MIN_GAIN:g}); "
            f"{needed(material, strongest.z, Z_BOUND)}")


def needed(material: Material, z: float, bound: float) -> str:
    """How much material would decide at the measured gain and spread (z grows as sqrt(targets)), and how to get it."""
    count = material.count
    if z <= 0 or not math.isfinite(z):
        return "more of this material would not decide it"
    more = math.ceil(count * (bound / z) ** 2)
    text = f"at this gain and spread about {more} {_unit(material)} would decide"
    if "--text" in material.source:
        return text + " (a longer --text; without --text fit scores its shipped prose)"
    if "shipped prose" in material.source:
        return text + " ([checks.fit] text_tokens sets how many tokens of the shipped prose are scored)"
    return text


def _source(material: Material) -> str:
    if "--text" in material.source:
        return "--text"
    return "the shipped prose" if "shipped prose" in material.source else "repeated random sequences"


def _unit(material: Material) -> str:
    return "copy targets" if material.distances else "tokens"
