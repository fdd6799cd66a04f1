"""Scoring candidates and judging them: a paired per-token test against the configuration as loaded.

For each target t, d_t = loss_configured(t) - loss_alternative(t) (nats; positive: the alternative predicts it
better). gain = mean d, z = gain / (sd(d) / sqrt(n)). An alternative beats the configuration when z >= Z_BOUND
and gain >= MIN_GAIN. Both bounds come from SmolLM2-135M on the shipped prose (the figures are in the package
docstring): healthy, every alternative is worse (nearest rope_theta x1/4, -0.049 nats, z = -4.8, over 1023
targets), while the three planted mistakes are beaten by their fix by 0.16 to 2.2 nats at z = 9.2 to 22.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from posdiag.checks.fit.alternatives import Alternative
from posdiag.checks.fit.material import Material
from posdiag.model.logits import score_targets
from posdiag.model.subject import Subject

Z_BOUND = 5.0  # paired z an alternative must reach (healthy: every alternative below 0; tokens are correlated)
MIN_GAIN = 0.03  # nats per target an alternative must gain (healthy nearest: -0.05; planted: >= 0.16)
COPY_TRAINED = 0.9  # copy accuracy of the best candidate that shows repeated sequences are the model's task
UNIGRAM_MARGIN = 0.1  # nats below the targets' unigram entropy the best candidate must reach


@dataclass(frozen=True)
class Scored:
    """One candidate's scores on the material: per-target losses (nats) and argmax hits."""

    label: str
    losses: np.ndarray
    hits: np.ndarray
    targets: np.ndarray | None = field(default=None, repr=False)  # the target ids, in the order of `losses`

    @property
    def loss(self) -> float:
        return float(self.losses.mean())

    def split(self, count: int) -> tuple[Scored, Scored]:
        """The first `count` targets (the first rows scored) and the rest."""
        ids = (None, None) if self.targets is None else (self.targets[:count], self.targets[count:])
        return (Scored(self.label, self.losses[:count], self.hits[:count], ids[0]),
                Scored(self.label, self.losses[count:], self.hits[count:], ids[1]))

    def joined(self, later: Scored) -> Scored:
        """These targets followed by those of rows scored after them."""
        ids = None if self.targets is None or later.targets is None else np.concatenate([self.targets, later.targets])
        return Scored(self.label, np.concatenate([self.losses, later.losses]), np.concatenate([self.hits, later.hits]),
                      ids)


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
    return Scored(label, (-out.logprob[keep]).numpy(), out.hit[keep].numpy(), material.targets[keep].numpy())


def compare(alternative: Alternative, configured: Scored, scored: Scored) -> Comparison:
    d = configured.losses - scored.losses
    gain = float(d.mean())
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    if not np.isfinite(gain):
        z = -math.inf if np.isnan(scored.losses).any() or np.isinf(scored.losses).any() else math.inf
    else:
        z = gain / (sd / math.sqrt(d.size)) if sd > 0 else (0.0 if gain == 0 else math.copysign(math.inf, gain))
    return Comparison(alternative, scored, gain, z)


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
