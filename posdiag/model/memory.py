"""The one memory-budget rule of posdiag, and what it measures: free memory and weight copies."""

from __future__ import annotations

import os

import torch

from posdiag.model.subject import Subject

UNKNOWN_FREE_BYTES = 8 << 30  # assumed free memory where the system does not say


def memory_allows(subject: Subject, extra_bytes: int, fraction: float) -> bool:
    """The memory-budget rule: `extra_bytes` fit in `fraction` of the free memory of the subject's device."""
    return extra_bytes < fraction * free_memory(subject.device)


def free_memory(device: torch.device | str) -> int:
    """Free bytes: a CUDA device's free memory; otherwise the available physical memory
    (UNKNOWN_FREE_BYTES where the system does not say)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return UNKNOWN_FREE_BYTES


def weight_bytes(subject: Subject, dtype: torch.dtype) -> int:
    """Bytes of a copy of every parameter of the model in `dtype`."""
    return sum(p.numel() for p in subject.model.parameters()) * dtype.itemsize
