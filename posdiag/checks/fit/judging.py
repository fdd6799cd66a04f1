"""Scoring candidates and judging them: a paired per-token test against the configuration as loaded.

For each target t, d_t = loss_configured(t) - loss_alternative(t) (nats; positive: the alternative predicts it
better). gain = mean d, z = gain / (sd(d) / sqrt(n)). An alternative beats the configuration when z >= Z_BOUND
and gain >= MIN_GAIN. Both bounds come from SmolLM2-135M on the shipped prose (the figures are in the package
docstring): healthy, every alternative is worse (nearest rope_theta x1/4, -0.049 nats, z = -4.8, over 1023
targets), while the three planted mistakes are beaten by their fix by 0.16 to 2.2 nats at z = 9.2 to 22.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from posdiag.checks.fit.alternatives import Alternative
from posdiag.checks.fit.material import Material
from posdiag.model.logits import score_targets
from posdiag.model.subject import Subject

Z_BOUND = 5.0  # paired z an alternative must reach (healthy: every alternative below 0; tokens are correlated)
MIN_GAIN = 0.03  # nats per target an alternative must gain (healthy nearest: -0.05; planted: >= 0.16)
# nats a trained model gains from its context over a destroyed one. Measured: SmolLM2-135M on shuffled prose +3.9,
# rope-copy +11.7 (its q/k rows interleaved +3.2, loss above chance); untrained, at most +0.001 (8 default-init and 2
# strong-init zoo families, the default-init Gemma-3-270M shape -0.003)
CONTEXT_GAIN = 0.5
SETTLED = 3.0  # standard errors below CONTEXT_GAIN that let the screen stop after its first row
COPY_TRAINED = 0.9  # copy accuracy of the best candidate that shows repeated sequences are the model's task
UNIGRAM_MARGIN = 0.1  # nats below the targets' unigram entropy the best candidate must reach


@dataclass(frozen=True)
class Scored:
    """One candidate's scores on the material: per-target losses (nats) and argmax hits."""

    label: str
    losses: np.ndarray
    hits: np.ndarray

    @property
    def loss(self) -> float:
        return float(self.losses.mean())

    def split(self, count: int) -> tuple[Scored, Scored]:
        """The first `count` targets (the first rows scored) and the rest."""
        return (Scored(self.label, self.losses[:count], self.hits[:count]),
                Scored(self.label, self.losses[count:], self.hits[count:]))

    def joined(self, later: Scored) -> Scored:
        """These targets followed by those of rows scored after them."""
        return Scored(self.label, np.concatenate([self.losses, later.losses]), np.concatenate([self.hits, later.hits]))


@dataclass(frozen=True)
class Comparison:
    alternative: Alternative
    scored: Scored
    gain: float  # nats per target the alternative gains over the configuration (negative: it loses)
    z: float

    @property
    def beats(self) -> bool:
        return self.z >= Z_BOUND and self.gain >= MIN_GAIN


def score(subject: Subject, material: Material, label: str, shift: int = 0) -> Scored:
    """The material scored with the model as it is now; `shift` added to the model's own position ids."""
    positions = None
    if shift:
        logical = torch.arange(material.ids.shape[1])[None].expand(material.ids.shape[0], -1)
        positions = (subject.position_ids_for(logical) + shift).clamp(min=0)
    out = score_targets(subject, material.ids, material.targets, position_ids=positions)
    keep = material.targets >= 0
    return Scored(label, (-out.logprob[keep]).numpy(), out.hit[keep].numpy())


def compare(alternative: Alternative, configured: Scored, scored: Scored) -> Comparison:
    d = configured.losses - scored.losses
    gain = float(d.mean())
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    if not np.isfinite(gain):
        z = -math.inf if np.isnan(scored.losses).any() or np.isinf(scored.losses).any() else math.inf
    else:
        z = gain / (sd / math.sqrt(d.size)) if sd > 0 else (0.0 if gain == 0 else math.copysign(math.inf, gain))
    return Comparison(alternative, scored, gain, z)


def context_gain(configured: Scored, twin: Scored) -> tuple[float, float]:
    """(gain, its standard error): mean twin loss - mean configured loss over the same stretch (the configured
    material's first targets, as many as the twin has), Welch's spread of that difference."""
    mine = configured.losses[:twin.losses.size]
    gain = float(twin.losses.mean() - mine.mean())
    spread = math.sqrt(float(mine.var(ddof=1)) / mine.size + float(twin.losses.var(ddof=1)) / twin.losses.size)
    return gain, spread


def learned_nothing(configured: Scored, twin: Scored) -> str:
    """Why the configured model cannot be judged, or "": it predicts the material no better than its destroyed twin
    (material.destroyed: the same targets without the context that makes them predictable). gain = mean twin loss
    - mean configured loss over the same stretch, z its Welch statistic; a trained model gains >= CONTEXT_GAIN at
    z >= Z_BOUND whatever its loss (its positions broken included), an untrained one gains nothing, whether its loss
    sits at chance or not (Gemma's scaled embeddings, large random weights: confidently wrong on both)."""
    gain, spread = context_gain(configured, twin)
    z = gain / spread if spread > 0 else (math.inf if gain > 0 else 0.0)
    if not np.isfinite(gain) or (gain >= CONTEXT_GAIN and z >= Z_BOUND):  # non-finite losses: for the alternatives
        return ""
    mine = configured.losses[:twin.losses.size]
    return (f"the model predicts like an untrained one (loss {mine.mean():.2f} nats on its material, "
            f"{twin.losses.mean():.2f} with the context destroyed: gain {gain:+.3f}, z = {z:.1f}): "
            "no configuration can be preferred")


def settled_untrained(configured: Scored, twin: Scored) -> bool:
    """Whether a first stretch already rules a trained model out: its gain lies more than SETTLED standard errors
    below CONTEXT_GAIN, so more rows could not lift it to the bound (default-init models: gain ~0, error ~0.1 nats
    over one 126-target row; the q/k-interleaved SmolLM2 on repeated sequences +0.61 there: not settled)."""
    gain, spread = context_gain(configured, twin)
    return bool(np.isfinite(gain) and np.isfinite(spread) and gain + SETTLED * spread < CONTEXT_GAIN)


def not_its_task(best: Scored, material: Material) -> str:
    """Why repeated random sequences cannot rank this model's configurations, or "": they are the training task of a
    model trained to copy (the rope-copy fixture copies nearly all of them), not of a text model, whose in-context
    copying at short distances goes better under a lower rope_theta than its own (SmolLM2-135M without its
    tokenizer: the configured 1e5 loses to 1e4 by 0.72 nats over 688 copy targets, z = 15.7, while it copies only
    70-77% of them). Decided on the best candidate, so a model whose configuration is broken still qualifies."""
    if not material.distances:
        return ""
    accuracy = float(best.hits.mean()) if best.hits.size else 0.0
    if accuracy >= COPY_TRAINED:
        return ""
    return (f"no text to score it on ({material.source}): repeated random sequences rank configurations only for a "
            f"model trained to copy them, and its best candidate copies {accuracy:.0%} of their targets (a trained "
            f"copier: >= {COPY_TRAINED:.0%}); a text model's copying prefers other rope_theta values than its own. "
            "Give the checkpoint its tokenizer files to score text")


def below_unigram(best: Scored, unigram: float) -> str:
    """Why no candidate uses context (none is below the unigram baseline), or ""."""
    if best.loss > unigram - UNIGRAM_MARGIN:
        return (f"no candidate predicts better than the targets' own frequencies (best loss {best.loss:.2f} nats, "
                f"unigram {unigram:.2f}): nothing shows how the weights use positions")
    return ""


def copy_accuracy(scored: Scored, distances: tuple[int, ...], material: Material) -> dict[int, float]:
    """Accuracy per copy distance (rows of `material`, each with its distance)."""
    per_row = (material.targets >= 0).sum(dim=1).tolist()
    out: dict[int, list[int]] = {}
    start = 0
    for n, count in zip(distances, per_row, strict=True):
        cell = out.setdefault(n, [0, 0])
        cell[0] += int(scored.hits[start:start + count].sum())
        cell[1] += count
        start += count
    return {n: hit / total for n, (hit, total) in sorted(out.items()) if total}
