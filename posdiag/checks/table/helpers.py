"""Pieces every part of the table check shares: a measurement's verdict, the decoder probe's encoder
input, a relative distance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.model.subject import Subject
from posdiag.results import Status


@dataclass
class Part:
    """One measurement's verdict, to be folded into the check's result."""

    name: str
    status: Status
    message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def encoder_ids(subject: Subject, stack: str, ids: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Decoder probes of an encoder-decoder: a short fixed encoder input (at most 8 tokens), so a
    decoder probe at or past the context exercises the decoder's table, not the encoder's."""
    if not (subject.kind == "seq2seq" and stack == "decoder"):
        return None
    return ids[: min(8, len(ids))][None].expand(rows, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom else float((a - b).norm())
