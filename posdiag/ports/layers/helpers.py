"""Layers compared, helpers: layer alignment and names, dtype arithmetic."""

from __future__ import annotations

import torch

from posdiag.errors import PosdiagError
from posdiag.model.subject import Outputs
from posdiag.ports.reference import name_of
from posdiag.verdict import MACHINE_EPSILON


def parse_layer_map(text: str) -> dict[int, int]:
    """'0:0,1:2,2:4' -> {0: 0, 1: 2, 2: 4} (hidden-state indices: 0 = embeddings, i = block i)."""
    mapping: dict[int, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        left, sep, right = part.partition(":")
        if not sep or not left.strip().lstrip("-").isdigit() or not right.strip().lstrip("-").isdigit():
            raise PosdiagError(f"--layer-map entry '{part}' is not REF:CAND (hidden-state indices, 0 = embeddings)")
        mapping[int(left)] = int(right)
    if not mapping:
        raise PosdiagError("--layer-map is empty")
    return mapping


def layer_pairs(n_ref: int, n_cand: int, layer_map: dict[int, int] | None) -> tuple[list[tuple[int, int]], str]:
    if layer_map:
        pairs = []
        for r, c in layer_map.items():
            rr, cc = r % n_ref if -n_ref <= r < n_ref else None, c % n_cand if -n_cand <= c < n_cand else None
            if rr is None or cc is None:
                raise PosdiagError(f"--layer-map {r}:{c} is out of range ({n_ref} reference and {n_cand} candidate "
                                   "hidden states)")
            pairs.append((rr, cc))
        return sorted(pairs), ""
    if n_ref == n_cand:
        return [(i, i) for i in range(n_ref)], ""
    return [(0, 0), (n_ref - 1, n_cand - 1)], (f"layer counts differ ({n_ref - 1} vs {n_cand - 1} blocks): comparing "
                                               "embeddings and the final output only (map the rest with --layer-map)")


def layer_name(index: int, total: int, stack: str, kind: str) -> str:
    base = "embeddings" if index == 0 and total > 1 else f"block {index}"
    return f"{stack} {base}" if kind == "seq2seq" else base


def first_non_finite(out: Outputs) -> int | None:
    for i, h in enumerate(out.hidden):
        if not bool(torch.isfinite(h).all()):
            return i
    return None


def epsilon(dtype: torch.dtype) -> float:
    return MACHINE_EPSILON.get(name_of(dtype), 1.2e-7)


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if epsilon(a) >= epsilon(b) else b

