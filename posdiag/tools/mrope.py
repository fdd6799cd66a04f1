"""Multimodal RoPE sections (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V, Omni thinkers): which rotary pairs
each position stream (t, h, w) drives, and the critical pair, wavelengths and unseen phases per stream.

`rope_parameters["mrope_section"]` gives the pair counts [t, h, w] (they sum to rotary_dim / 2). Two layouts:
- chunked (Qwen2-VL, Qwen2.5-VL): t takes pairs [0, t), h the next h, w the last w;
- interleaved (Qwen3-VL, `mrope_interleaved`): pair i goes to h when i % 3 == 1 and i < 3h, to w when
  i % 3 == 2 and i < 3w, else to t.
For text tokens the three streams are equal, so the rotation is plain RoPE; for an image grid each stream sees
only its own pairs, so a stream's usable range is set by *its* pairs: in the chunked layout t holds the fast
pairs and h/w the slow ones (a long video meets unseen phases on t first), interleaved spreads every stream over
the whole spectrum.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

STREAMS = ("t", "h", "w")


@dataclass(frozen=True)
class Section:
    """One position stream's pairs and what they reach (pair indices are 0-based over the whole head)."""

    stream: str
    layout: str  # chunked | interleaved
    pairs: tuple[int, ...]
    critical_pair: int | None  # the stream's first pair with λ > L (a global index); None: all turned within L
    shortest_wavelength: float
    longest_wavelength: float
    unseen_at_target: int  # the stream's pairs meeting phases never seen in training at N

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "layout": self.layout, "pairs": len(self.pairs), "first_pair": self.pairs[0],
                "last_pair": self.pairs[-1], "critical_pair": self.critical_pair,
                "shortest_wavelength": self.shortest_wavelength, "longest_wavelength": self.longest_wavelength,
                "unseen_pairs_at_target": self.unseen_at_target}


def mrope_section(params: dict[str, Any] | None) -> list[int] | None:
    section = (params or {}).get("mrope_section")
    return [int(x) for x in section] if isinstance(section, (list, tuple)) and len(section) == 3 else None


def layout(config: Any, params: dict[str, Any]) -> str:
    """`mrope_interleaved` when the config says; else what the model's own rotary code does (Qwen3-VL
    interleaves without a config key: its recomposition strides the pairs by 3)."""
    for key in ("mrope_interleaved", "interleaved"):
        if key in params:
            return "interleaved" if params[key] else "chunked"
    name = type(config).__module__.replace("configuration_", "modeling_")
    try:
        source = inspect.getsource(importlib.import_module(name))
    except Exception:  # no modelling module to read: the original (Qwen2-VL) layout
        return "chunked"
    return "interleaved" if ("mrope_section[dim] * 3" in source or "apply_interleaved_mrope" in source) else "chunked"


def stream_pairs(section: list[int], kind: str) -> dict[str, np.ndarray]:
    """stream -> the pair indices it drives."""
    total = sum(section)
    idx = np.arange(total)
    if kind == "chunked":
        edges = np.cumsum([0, *section])
        return {s: idx[edges[i]:edges[i + 1]] for i, s in enumerate(STREAMS)}
    owner = np.zeros(total, dtype=int)
    for stream in (1, 2):
        owner[(idx % 3 == stream) & (idx < 3 * section[stream])] = stream
    return {s: idx[owner == i] for i, s in enumerate(STREAMS)}


def sections(config: Any, params: dict[str, Any] | None, freqs: np.ndarray, training_length: int,
             target_length: int) -> tuple[Section, ...]:
    """Per stream: its pairs, critical pair, wavelength range and unseen pairs; () without mrope_section
    (or when the sections do not add up to the rotary pairs: reported by nothing rather than misread)."""
    section = mrope_section(params)
    if section is None or sum(section) != freqs.shape[0]:
        return ()
    kind = layout(config, params or {})
    lam = 2 * np.pi / np.asarray(freqs, dtype=np.float64)
    out = []
    for stream, pairs in stream_pairs(section, kind).items():
        if pairs.size == 0:
            continue
        beyond = pairs[lam[pairs] > training_length]
        out.append(Section(stream, kind, tuple(int(p) for p in pairs), int(beyond[0]) if beyond.size else None,
                           float(lam[pairs].min()), float(lam[pairs].max()),
                           int(((lam[pairs] > training_length) & (target_length > training_length)).sum())))
    return tuple(out)
