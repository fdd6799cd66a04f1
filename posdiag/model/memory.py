"""The one memory-budget rule of posdiag, and what it measures: free memory, weight copies and the peak of a
forward a check is about to run (planned from the shapes before it runs: a probe that would not fit is shortened or
skipped with these figures, never killed by the operating system)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch

from posdiag.model.subject import Subject

UNKNOWN_FREE_BYTES = 8 << 30  # assumed free memory where the system does not say
FORWARD_FRACTION = 0.5  # of the free memory one planned forward may take (the estimate leaves out the allocator's
#                         fragmentation and the framework's temporaries)
EAGER_SCORE_COPIES = 3  # [B, H, T, K] tensors alive at once in eager attention: scores, scores + mask, softmax
CGROUP_FILES = (("memory.max", "memory.current"),  # cgroup v2, then v1
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def memory_allows(subject: Subject, extra_bytes: int, fraction: float) -> bool:
    """The memory-budget rule: `extra_bytes` fit in `fraction` of the free memory of the subject's device."""
    return extra_bytes < fraction * free_memory(subject.device)


def free_memory(device: torch.device | str) -> int:
    """Free bytes: a CUDA device's free memory; otherwise the least of the available physical memory, the room left
    under the process's address-space limit (RLIMIT_AS: allocations past it fail) and under its cgroup's memory limit
    (past it the kernel kills the process). UNKNOWN_FREE_BYTES where none of them says."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    rooms = [r for r in (_physical(), _address_space_room(), _cgroup_room()) if r is not None]
    return max(0, min(rooms)) if rooms else UNKNOWN_FREE_BYTES


def _physical() -> int | None:
    """Linux's MemAvailable (free pages plus the page cache it can drop): free pages alone read low right after a
    large install or file copy (7 GB of cache on a 24 GB machine: 15.5 GB free of 22 available), which made
    `compare` fall back to an estimated floor and FAIL a healthy file. Free pages where /proc/meminfo is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_room() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        used = int(status.split("VmSize:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return soft - used


def _cgroup_room() -> int | None:
    root = Path("/sys/fs/cgroup")
    for limit_name, usage_name in CGROUP_FILES:
        try:
            limit, usage = (root / limit_name).read_text().strip(), (root / usage_name).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            return int(limit) - int(usage)
        return None
    return None


def weight_bytes(subject: Subject, dtype: torch.dtype) -> int:
    """Bytes of a copy of every parameter of the model in `dtype`."""
    return sum(p.numel() for p in subject.model.parameters()) * dtype.itemsize


def forward_bytes(subject: Subject, rows: int, length: int, *, keys: int | None = None,
                  logits_rows: int | None = None, hidden_states: bool = True, cache: bool = False) -> int:
    """The planned peak of one forward beyond the weights: `rows` sequences of `length` new tokens attending to
    `keys` positions (default: `length`), from the config's shapes. Counted: the attention mask [B, T, K] and the
    score matrices of the implementation in use (eager keeps EAGER_SCORE_COPIES of [B, H, T, K]; a fused kernel may
    fall back to its math path: one copy), one block's activations, every layer's hidden states when they are
    returned, the KV cache when one is kept, and the logits of `logits_rows` positions (default: all of them)."""
    cfg = _text_config(subject)
    item = subject.dtype.itemsize
    width = int(_field(cfg, "hidden_size", "n_embd", "d_model", default=256))
    heads = int(_field(cfg, "num_attention_heads", "n_head", "num_heads", default=8))
    kv_heads = int(_field(cfg, "num_key_value_heads", default=heads) or heads)
    head_dim = int(_field(cfg, "head_dim", default=width // max(1, heads)) or width // max(1, heads))
    layers = int(_field(cfg, "num_hidden_layers", "n_layer", "num_layers", default=12))
    inner = int(_field(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * width) or 4 * width)
    vocab = int(subject.vocab_size or 0)
    keys = length if keys is None else keys
    implementation = str(getattr(subject.config, "_attn_implementation", "eager") or "eager")
    copies = EAGER_SCORE_COPIES if implementation == "eager" else 1
    scores = rows * (copies * heads + 1) * length * keys * item
    block = rows * length * (4 * width + 2 * inner + 2 * heads * head_dim) * item
    states = (layers + 1) * rows * length * width * item if hidden_states else 0
    kv = 2 * layers * rows * keys * kv_heads * head_dim * item if cache else 0
    logits = 2 * rows * (length if logits_rows is None else logits_rows) * vocab * item
    return int(scores + block + states + kv + logits)


def forward_refusal(subject: Subject, what: str, rows: int, length: int, **shape: Any) -> str:
    """"" when the forward fits FORWARD_FRACTION of the free memory, else the sentence a check reports instead of
    running it: "the probe past the 32768-token window needs ~19 GB; 9.0 GB free: not run"."""
    need, free = forward_bytes(subject, rows, length, **shape), free_memory(subject.device)
    if need < FORWARD_FRACTION * free:
        return ""
    return f"{what} ({rows} x {length} tokens) needs ~{_size(need)}; {_size(free)} free: not run"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MB"


def _text_config(subject: Subject) -> Any:
    cfg = subject.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _field(cfg: Any, *names: str, default: Any = None) -> Any:
    """The first positive int among the config's `names`. A per-layer attribute (Gemma 4's head_dim raises when read
    globally) counts at its largest over the layers: an estimate of the peak must not come out low."""
    for name in names:
        try:
            value = getattr(cfg, name, None)
        except Exception:  # transformers refuses a global read of a per-layer attribute
            layers = getattr(cfg, "per_layer_config", None) or []
            values = [getattr(layer, name, None) for layer in layers]
            value = max((v for v in values if isinstance(v, int)), default=None)
        if isinstance(value, int) and value > 0:
            return value
    return default
