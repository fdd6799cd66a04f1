"""Repeated sequences without a copier: decided before every alternative has scored the whole material.

Repeated random sequences rank configurations only for a model trained to copy them (judging.not_its_task: its best
candidate must copy COPY_TRAINED of their targets). A text model checked without its tokenizer copies far less under
every configuration (SmolLM2-135M: 68-75%), and scoring each alternative on every row only to read that was most of
`fit`'s time. Where the configuration as loaded does not copy, each alternative is scored stage by stage (rows holding
about 1/STAGES of the targets each) while it can still reach COPY_TRAINED: hits so far plus every target not yet
scored. That bound is exact, so stopping loses nothing: where no candidate can reach it, the material is not the
model's task whichever candidate's loss is best; where one can, the stopped alternatives score their remaining rows
(rows are independent: the joined scores are the whole material's, up to the rounding of another batch size) and
`fit` judges as on any material.
"""

from __future__ import annotations

from posdiag.checks.fit.judging import COPY_TRAINED, Scored
from posdiag.checks.fit.material import Material

STAGES = 4  # stages the targets are split into where alternatives may stop early


def staged(material: Material, configured: Scored) -> bool:
    """Whether alternatives are scored stage by stage: repeated sequences the configuration does not copy."""
    return bool(material.distances) and copied(configured) < COPY_TRAINED


def copied(scored: Scored) -> float:
    """The share of the scored targets the candidate's argmax copied."""
    return float(scored.hits.mean()) if scored.hits.size else 0.0


def stage_rows(material: Material) -> list[int]:
    """Row boundaries of the stages (each stage's last row + 1), the last one every row."""
    per_row = (material.targets >= 0).sum(dim=1).cumsum(0).tolist()
    total = per_row[-1] if per_row else 0
    bounds: list[int] = []
    for k in range(1, STAGES):
        row = next((r + 1 for r, count in enumerate(per_row) if count >= total * k / STAGES), len(per_row))
        if row < len(per_row) and (not bounds or row > bounds[-1]):
            bounds.append(row)
    return bounds + [len(per_row)]


def out_of_reach(scored: Scored, total: int) -> bool:
    """Whether even every target not yet scored copied would leave the candidate short of COPY_TRAINED."""
    return total > 0 and (int(scored.hits.sum()) + total - scored.hits.size) / total < COPY_TRAINED


def none_copies(material: Material, configured: Scored, partial: list[Scored]) -> str:
    """Why the material cannot rank this model, where the configuration and every alternative were found out of
    reach of COPY_TRAINED (the alternatives on the targets they scored)."""
    sizes = sorted(s.hits.size for s in partial)
    scored = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"
    return (f"no text to score it on ({material.source}): repeated random sequences rank configurations only for a "
            f"model trained to copy them (>= {COPY_TRAINED:.0%} of their targets), and no candidate does: the "
            f"configuration copies {copied(configured):.0%} of {material.count}, and each of the {len(partial)} "
            f"alternatives fell out of reach after {scored} of them (copying at most "
            f"{max(copied(s) for s in partial):.0%} of those); a text model's copying prefers other rope_theta values "
            "than its own. Give the checkpoint its tokenizer files to score text")
