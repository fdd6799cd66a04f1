"""Pure RoPE math from a config: frequencies, wavelengths, turns, the critical pair, aliasing, decay.

No model is built here. The specs and their frequencies are read from the config by posdiag.tools.rope_config
(its names are importable from here too); this module says what a frequency set means.

Definitions (DESIGN.md, "RoPE analysis"): with frequencies θ_i after scaling, wavelength λ_i = 2π/θ_i, training
length L (the original length when the scaling block gives one) and target length N:
- critical pair: the first pair (0-based) with λ_i > L; from it on, pairs never finished a turn in training and
  meet unseen phases past L.
- pattern similarity s(D) = mean_i cos(D θ_i); the alias is the smallest D past the curve's first dip below 1-ε
  at which s(D) returns to >= 1-ε ("none up to N" is a valid answer).
- decay: sum_i cos(D θ_i) (q = k = ones); its first zero is information, never a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from posdiag.tools.rope_config import (
    STATEFUL_TYPES,
    RopeSpec,
    declared_context,
    default_inv_freq,
    head_dim_of,
    inv_freq,
    layer_config,
    nope_layers,
    rope_parameters,
    rope_specs,
    text_config,
    unscaled_inv_freq,
)

__all__ = ["ALIAS_EPSILON", "SCAN_LIMIT", "STATEFUL_TYPES", "Analysis", "RopeSpec", "SpecReport", "alias_offset",
           "analyze", "analyze_config", "critical_pair", "decay_curve", "decay_first_zero", "declared_context",
           "default_inv_freq", "head_dim_of", "inv_freq", "layer_config", "nope_layers", "report_spec",
           "rope_parameters", "rope_specs", "text_config", "unscaled_inv_freq", "wavelengths"]

ALIAS_EPSILON = 0.02
SCAN_LIMIT = 1 << 21  # offsets scanned for aliasing / decay (64 pairs x 2M offsets: one matrix product per 128k)


@dataclass(frozen=True)
class Analysis:
    """The figures DESIGN asks for, for one frequency set."""

    freqs: np.ndarray
    wavelengths: np.ndarray
    training_length: int
    target_length: int
    turns_training: np.ndarray
    turns_target: np.ndarray
    unseen: np.ndarray  # bool per pair: meets phases never seen in training at the target length
    critical_pair: int | None  # first pair with λ > L (0-based); None: every pair turned within L
    alias_offset: int | None  # smallest far D with s(D) >= 1-ε; None: none up to alias_scanned
    alias_epsilon: float
    alias_scanned: int
    decay_first_zero: int | None
    decay_scanned: int

    @property
    def pairs(self) -> int:
        return int(self.freqs.shape[0])

    @property
    def longest_wavelength(self) -> float:
        finite = self.wavelengths[np.isfinite(self.wavelengths)]
        return float(finite.max()) if finite.size else math.inf

    @property
    def unseen_pairs(self) -> int:
        return int(self.unseen.sum())

    def summary(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "training_length": self.training_length,
            "target_length": self.target_length,
            "critical_pair": self.critical_pair,
            "shortest_wavelength": float(self.wavelengths.min()),
            "longest_wavelength": self.longest_wavelength,
            "unseen_pairs_at_target": self.unseen_pairs,
            "alias_offset": self.alias_offset,
            "alias_epsilon": self.alias_epsilon,
            "alias_scanned_to": self.alias_scanned,
            "decay_first_zero": self.decay_first_zero,
            "decay_scanned_to": self.decay_scanned,
        }


def wavelengths(freqs: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(freqs > 0, 2 * np.pi / np.where(freqs > 0, freqs, 1.0), np.inf)


def critical_pair(freqs: np.ndarray, training_length: int) -> int | None:
    over = np.nonzero(wavelengths(freqs) > training_length)[0]
    return int(over[0]) if over.size else None


def _scan(freqs: np.ndarray, limit: int, width: int = 4096, block: int = 32):
    """Yield (offsets, mean_i cos(D θ_i)) for D = 1 .. limit, `width * block` offsets at a time.

    cos((D0 + d) θ) = Re(e^{i D0 θ} e^{i d θ}): one table of e^{i d θ} for d < width, and per block of
    starting offsets D0 a matrix product with e^{i D0 θ} (BLAS), instead of a cosine per (D, pair)."""
    theta = freqs[freqs > 0].astype(np.float64)
    if theta.size == 0:
        return
    table = np.exp(1j * np.outer(np.arange(width, dtype=np.float64), theta))  # [width, pairs]
    first = 1
    while first <= limit:
        starts = first + width * np.arange(block, dtype=np.float64)
        sums = table @ np.exp(1j * np.outer(theta, starts))  # [width, block]: column k holds D = starts[k] + d
        d = (starts[None, :] + np.arange(width, dtype=np.float64)[:, None]).T.ravel()
        s = (sums.real / theta.size).T.ravel()
        keep = d <= limit
        yield d[keep], s[keep]
        first += width * block


def alias_offset(freqs: np.ndarray, limit: int, epsilon: float = ALIAS_EPSILON) -> int | None:
    """Smallest D past the first dip below 1-ε where s(D) = mean_i cos(D θ_i) returns to >= 1-ε."""
    left = False
    for d, s in _scan(freqs, limit):
        if not left:
            below = np.nonzero(s < 1 - epsilon)[0]
            if not below.size:
                continue
            left = True
            d, s = d[below[0]:], s[below[0]:]
        back = np.nonzero(s >= 1 - epsilon)[0]
        if back.size:
            return int(d[back[0]])
    return None


def decay_first_zero(freqs: np.ndarray, limit: int) -> int | None:
    """First offset D where sum_i cos(D θ_i) <= 0 (the long-range decay of <R_m 1, R_n 1>)."""
    for d, s in _scan(freqs, limit):
        hit = np.nonzero(s <= 0)[0]
        if hit.size:
            return int(d[hit[0]])
    return None


def decay_curve(freqs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    theta = freqs[freqs > 0]
    return np.cos(np.outer(offsets.astype(np.float64), theta)).sum(axis=1)


def analyze(freqs: np.ndarray, training_length: int, target_length: int,
            epsilon: float = ALIAS_EPSILON, scan_limit: int = SCAN_LIMIT) -> Analysis:
    freqs = np.asarray(freqs, dtype=np.float64)
    lam = wavelengths(freqs)
    limit = int(min(max(target_length, training_length), scan_limit))
    return Analysis(
        freqs=freqs, wavelengths=lam, training_length=int(training_length), target_length=int(target_length),
        turns_training=training_length * freqs / (2 * np.pi), turns_target=target_length * freqs / (2 * np.pi),
        unseen=(lam > training_length) & (target_length > training_length),
        critical_pair=critical_pair(freqs, training_length),
        alias_offset=alias_offset(freqs, limit, epsilon), alias_epsilon=epsilon, alias_scanned=limit,
        decay_first_zero=decay_first_zero(freqs, limit), decay_scanned=limit,
    )


@dataclass(frozen=True)
class SpecReport:
    """Before/after scaling for one spec, plus the evidence-backed warnings."""

    spec: RopeSpec
    attention_scaling: float
    before: Analysis
    after: Analysis
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    sections: tuple = ()  # mrope.Section per position stream (t, h, w) of multimodal RoPE; () otherwise


def report_spec(config: Any, spec: RopeSpec, target_length: int | None = None) -> SpecReport:
    """Static analysis of one spec: unscaled vs scaled frequencies at L and N, and warnings on evidence."""
    training = spec.training_length or target_length or 4096
    target = int(target_length or spec.declared or training)
    seq_len = target if spec.stateful else None
    after_freqs, scaling = inv_freq(config, spec, seq_len=seq_len)
    before = analyze(unscaled_inv_freq(spec), training, target)
    after = analyze(after_freqs, training, target) if spec.rope_type != "default" else before
    warnings, notes = [], []
    claimed = spec.claimed_length
    if claimed and target > claimed:
        warnings.append(
            f"{spec.label}: target {target} is beyond the {claimed} tokens the config claims; "
            f"{after.unseen_pairs} of {after.pairs} pairs meet phases never seen in training"
        )
    if (spec.rope_type == "default" and spec.original_max and spec.declared and spec.declared > spec.original_max):
        at_declared = analyze(after.freqs, spec.original_max, spec.declared, scan_limit=1)
        if at_declared.unseen_pairs:
            warnings.append(
                f"{spec.label}: declared context {spec.declared} exceeds the original training length "
                f"{spec.original_max} with no scaling; {at_declared.unseen_pairs} pairs meet unseen phases before it"
            )
    if spec.stateful:
        notes.append(f"{spec.rope_type} frequencies depend on the sequence length (switch at {spec.switch_length}); "
                     f"shown at length {target}")
    if after.decay_first_zero is not None:
        notes.append(f"{spec.label}: decay curve first crosses zero at offset {after.decay_first_zero} (information)")
    from posdiag.tools import mrope

    streams = mrope.sections(text_config(config), spec.params, after.freqs, training, target)
    return SpecReport(spec, scaling, before, after, tuple(warnings), tuple(notes), streams)


def analyze_config(config: Any, target_length: int | None = None) -> list[SpecReport]:
    return [report_spec(config, spec, target_length) for spec in rope_specs(config)]
