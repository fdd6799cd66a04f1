"""The angles an honest rotation turns each pair by, and how far float32 may move them: what the applied
rotation and the rotation tables are held to."""

from __future__ import annotations

import numpy as np


def reference_angles(freqs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[P, pairs] angles p θ_i in float64."""
    return np.outer(np.asarray(positions, dtype=np.float64), np.asarray(freqs, dtype=np.float64))


def angle_tolerance(freqs: np.ndarray, positions: np.ndarray, out_epsilon: float) -> np.ndarray:
    """[P, pairs] bound of an honest implementation: angles rounded in float32 (whatever the model dtype), then
    cos/sin rounded to the output dtype."""
    return angle_bound(reference_angles(freqs, positions), out_epsilon)


def angle_bound(angles: np.ndarray, out_epsilon: float) -> np.ndarray:
    """The same bound for given angles (multimodal RoPE: each pair turned by its own stream's position)."""
    eps32 = float(np.finfo(np.float32).eps)
    return eps32 * (1.0 + np.abs(angles)) + out_epsilon
