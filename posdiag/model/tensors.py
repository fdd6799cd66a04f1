"""Small tensor helpers shared by every check (imported lazily: they need torch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def relative_l2(actual: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """||actual - expected|| / ||expected|| in float64, over `valid` positions (bool, broadcastable to [B, T])."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if valid is not None:
        a = a[valid]
        e = e[valid]
    denom = e.norm().item()
    num = (a - e).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool 'may attend' -> additive float mask (0 / finfo.min).

    Why not pass the bool mask: under eager attention transformers adds the 4D mask to the
    scores, so a bool mask adds 1/0 and blocks nothing (measured in every family, 5.x).
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill(~allowed, torch.finfo(dtype).min)


def causal_allowed(seq_len: int, device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
    """[T, T] bool: query i may see key j when j <= i (and i - j < window, if given)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


def permute_square(m: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """P M Pᵀ on the last two dims: row i of the result is row perm[i], column j is column perm[j]."""
    return m[..., perm, :][..., :, perm]


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def release_freed_memory() -> None:
    """Hand the heap that freed finer-dtype copies leave behind back to the system (glibc keeps it otherwise:
    every float64 re-run would raise the process's resident memory a little more). A no-op elsewhere."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def token_states(hidden: Any, length: int | tuple[int, ...]) -> list[torch.Tensor]:
    """Hidden-state entries as the tokens' states [B, length, ...]. Block-local encoders hand back more: PEGASUS-X's
    encoder returns its states padded to a whole number of blocks and its last entry as a pair (token states,
    global-token states). The tokens are the first `length` positions of the first tensor of an entry. Given the
    input's shape (B, length), an entry that stacks several streams of states per token ([streams, B, length, D]:
    Gemma 3n's AltUp keeps 4) becomes [B, length, streams * D], every stream kept, and an entry with fewer positions
    than tokens (Funnel's pooled blocks) is left out."""
    batch, length = (None, length) if isinstance(length, int) else (length[0], length[-1])
    out = []
    for h in hidden:
        while isinstance(h, (tuple, list)):
            h = h[0]
        if batch is not None and h.ndim == 4 and h.shape[1] == batch and h.shape[2] >= length:
            h = h.permute(1, 2, 0, 3).reshape(batch, h.shape[2], -1)
        if batch is not None and h.ndim == 3 and h.shape[0] == batch and h.shape[1] < length:
            continue  # a block over pooled tokens (Funnel halves the sequence per block): no state per token
        out.append(h[:, :length] if h.ndim >= 2 and h.shape[1] > length else h)
    return out



@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the block (None: unchanged). A model converted to float64 still
    builds constants in the default dtype: XGLM's `torch.full((), finfo(float64).min)` overflows float32."""
    saved = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def per_token_change(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """||a_t − e_t|| / ||e_t|| per token [T] in float64 (0 where both vanish); everything after the token dim is
    the token's state (DeepSeek-V4's hyper-connections carry [T, streams, D])."""
    a, e = (t.detach().double().reshape(t.shape[0], -1) for t in (actual, expected))
    num = (a - e).norm(dim=-1)
    den = e.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))


def layer_name(index: int, total: int | None = None) -> str:
    """Index 0 of a hidden-state list is the embeddings output (when there is more than one entry)."""
    return "embeddings" if index == 0 and (total is None or total > 1) else f"block {index}"
