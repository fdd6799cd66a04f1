"""What every comparison of a port returns: per-position error profiles and the one result they decide.

A profile is a candidate's error against its reference at every position (a layer's hidden states, the logits, a
served route's log-probs), beside the floor it is judged against; the Comparison is the CheckResult named
"compare" with the profiles behind it, which the reports draw (bucketed by position: early positions, where a
position bug rises, one by one; late ones coarsely).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from posdiag.results import CheckResult

_BUCKETS = 24

# Position pattern. A token at position 0 of a causal stack whose error is within ONSET_RATIO of
# the typical error elsewhere carries the bug itself (a weight or norm bug; measured 0.27-1.1 for
# a wrong norm epsilon in Llama/Qwen2/GPT-2 at both inits); a relative-position bug leaves it at
# the floor (measured exactly 0.0). Between the two (the error at position 0 real but more than
# 10x below the rest) the data says "grows, but not from zero": reported as such. Only relative
# positions spare position 0: an absolute table adds its row 0 to the first token, so a zeroed or
# missing GPT-2 table is as uniform (1.1x the median elsewhere) as a wrong norm weight.
UNIFORM_START_FRACTION = 0.1


@dataclass(frozen=True)
class LayerProfile:
    """One aligned layer: overall error, its floor, and the error at every position."""

    name: str
    ref_index: int | None
    cand_index: int | None
    error: float
    floor: float
    tolerance: float
    ratio: float
    per_position: tuple[float, ...]
    pattern: dict[str, Any] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        return not (self.error <= self.tolerance)  # NaN differs


@dataclass(frozen=True)
class Comparison:
    """The result (a CheckResult named "compare") and the per-position profiles behind it.

    profiles: one LayerProfile per aligned layer per stack (logits last, named "logits").
    """

    result: CheckResult
    profiles: tuple[LayerProfile, ...]
    seq_len: int


def rel_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    e, a = expected.detach().double().cpu(), actual.detach().double().cpu()
    denom = e.norm().item()
    num = (a - e).norm().item()
    return (0.0 if num == 0 else float("inf")) if denom == 0 else num / denom


def per_position_error(expected: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """||actual[t] - expected[t]|| / ||expected[t]|| for every position t (float64, CPU)."""
    e, a = expected.detach().double().cpu(), actual.detach().double().cpu()
    e, a = e.reshape(e.shape[0], -1), a.reshape(a.shape[0], -1)
    denom = e.norm(dim=-1)
    tiny = torch.finfo(torch.float64).tiny
    return (a - e).norm(dim=-1) / denom.clamp_min(tiny)


def bucket_edges(length: int, buckets: int = _BUCKETS) -> list[int]:
    """Position 0 alone, then geometrically growing buckets: early positions (where a position
    bug rises) are resolved one by one, late ones coarsely. Edges are bucket starts, then `length`."""
    edges = {0, 1}
    if length > 1:
        for k in range(buckets):
            edges.add(int(round(length ** (k / (buckets - 1)))))
    return sorted(e for e in edges if e < length) + [length]


def bucketed(profiles: list[LayerProfile], length: int) -> dict[str, Any]:
    edges = bucket_edges(length)
    layers = {}
    for p in profiles:
        values = torch.tensor(p.per_position, dtype=torch.float64)
        layers[p.name] = [values[s:e].mean().item() for s, e in pairwise(edges)]
    return {"bucket_starts": edges[:-1], "length": length, "mean_error": layers,
            "tolerance": {p.name: p.tolerance for p in profiles}, "floor": {p.name: p.floor for p in profiles}}
