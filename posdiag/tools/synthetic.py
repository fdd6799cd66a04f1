"""Synthetic attention comparison: every implementation on the same random q, k, v, no model.

`posdiag kernels --synthetic` and benchmarks/gpu_kernels.py: SDPA pinned to each backend that runs
here, posdiag's naive attention in the run dtype (the "plain PyTorch" baseline of FlashAttention's
rule) and posdiag's tiled online-softmax attention (tools/attention.py), each against a float64
reference, with time and peak memory; `judge_synthetic` applies FlashAttention's rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.model.memory import free_memory
from posdiag.tools.attention import MaskSpec, naive_attention, run_sdpa, sdpa_backends, tiled_attention


@dataclass(frozen=True)
class Shape:
    batch: int = 2
    heads: int = 8
    kv_heads: int = 8
    q_len: int = 256
    k_len: int = 256
    head_dim: int = 64
    causal: bool = True
    alignment: str = "bottom_right"
    padding: int = 0  # left padding of the last row (keys), in tokens
    window: int | None = None
    dtype: str = "float32"
    device: str = "cpu"

    def spec(self, device: Any = "cpu") -> MaskSpec:
        key_valid = None
        if self.padding:
            key_valid = torch.ones(self.batch, self.k_len, dtype=torch.bool, device=device)
            key_valid[-1, : min(self.padding, self.k_len)] = False
        return MaskSpec(self.q_len, self.k_len, self.causal, self.alignment, self.window, key_valid)


@dataclass
class Measurement:
    name: str
    status: str  # "ok" | "unsupported" | "error"
    error: float = float("nan")  # relative L2 vs the float64 reference, rows that see a key
    max_abs: float = float("nan")
    seconds: float = float("nan")
    peak_bytes: int | None = None
    empty_rows: str = ""  # what the implementation put in rows that see no key
    note: str = ""
    valid_non_finite: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "status", "error", "max_abs", "seconds", "peak_bytes",
                                               "empty_rows", "note", "valid_non_finite")}


def random_qkv(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from posdiag.model.tensors import DTYPES

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[shape.dtype]
    q = torch.randn(shape.batch, shape.heads, shape.q_len, shape.head_dim, generator=gen)
    k = torch.randn(shape.batch, shape.kv_heads, shape.k_len, shape.head_dim, generator=gen)
    v = torch.randn(shape.batch, shape.kv_heads, shape.k_len, shape.head_dim, generator=gen)
    return q.to(shape.device, dt), k.to(shape.device, dt), v.to(shape.device, dt)


def compare_errors(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> tuple[float, float, bool, str]:
    """(relative L2, max |Δ| over rows that see a key, non-finite there?, what empty rows hold)."""
    rows = rows.expand(out.shape[0], out.shape[1], -1)
    a, r = out.to(torch.float64)[rows], ref[rows]
    non_finite = not bool(torch.isfinite(a).all())
    denom = r.norm().item()
    err = (a - r).norm().item() / denom if denom else float((a - r).norm().item())
    max_abs = (a - r).abs().max().item() if a.numel() else 0.0
    empty = out[~rows]
    if empty.numel() == 0:
        what = ""
    elif not bool(torch.isfinite(empty).all()):
        what = "NaN/Inf"
    elif bool((empty == 0).all()):
        what = "zeros"
    else:
        what = "finite non-zero"
    return err, max_abs, non_finite, what


def _measure(fn: Callable[[], torch.Tensor], device: torch.device, memory: bool,
             repeats: int) -> tuple[torch.Tensor, float, int | None]:
    out = fn()  # warm-up (and the output)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = None
    if memory:
        peak = peak_memory(fn, device)
    return out, (sorted(times)[len(times) // 2] if times else float("nan")), peak


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated while fn runs, beyond what was allocated before (inputs excluded)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return int(peak)
    if device.type != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, current)
    return int(peak)


def _memory_limit(device: torch.device, given: int | None) -> int:
    if given is not None:
        return given
    if device.type == "cuda":
        return int(0.3 * free_memory(device))
    return 8 << 30


def synthetic(shape: Shape, *, seed: int = 0, memory: bool = True, repeats: int = 3,
              backends: list[str] | None = None, naive_limit_bytes: int | None = None,
              reference_block: int = 1024) -> list[Measurement]:
    """Every implementation on the same random q, k, v: SDPA backends, posdiag naive (in the run
    dtype, the "plain PyTorch" baseline of FlashAttention's rule), posdiag tiled; the float64
    naive result is the reference for all of them. When the float64 score matrix does not fit
    (long sequences), the reference is posdiag's tiled attention run in float64 (exact to ~1e-15,
    linear memory) and the same-dtype naive baseline is left out."""
    device = torch.device(shape.device)
    q, k, v = random_qkv(shape, seed)
    spec = shape.spec(device)
    limit = _memory_limit(device, naive_limit_bytes)
    pairs = shape.batch * shape.heads * shape.q_len * shape.k_len
    results: list[Measurement] = []
    if pairs * 8 * 3 <= limit:
        ref = naive_attention(q, k, v, spec)
        ref_name = "naive float64"
    else:
        ref = tiled_attention(q.double(), k.double(), v.double(), spec, block_q=reference_block,
                              block_k=reference_block)
        ref_name = "tiled float64"
    rows = spec.rows_with_keys(device)
    run_dtype = q.dtype
    candidates: list[tuple[str, Callable[[], torch.Tensor] | None, str]] = []
    naive_name = "posdiag naive (" + shape.dtype + ")"
    if pairs * max(run_dtype.itemsize, 4) * 4 <= limit:
        candidates.append((naive_name, lambda: naive_attention(q, k, v, spec, dtype=run_dtype), ""))
    else:
        candidates.append((naive_name, None, f"score matrix would need {pairs * 4 * 4 / 2**30:.1f} GiB"))
    block = 128 if device.type == "cpu" else 256
    candidates.append(("posdiag tiled", lambda: tiled_attention(q, k, v, spec, block_q=block, block_k=block), ""))
    for backend in backends or sdpa_backends(device):
        candidates.append((f"sdpa {backend}", lambda b=backend: run_sdpa(b, q, k, v, spec), ""))
    for name, fn, why in candidates:
        if fn is None:
            results.append(Measurement(name, "unsupported", note=why))
            continue
        try:
            out, seconds, peak = _measure(fn, device, memory, repeats)
        except Exception as exc:  # a backend that refuses these inputs says why
            text = str(exc).strip().splitlines()
            note = (text[0] if text else type(exc).__name__)[:160]
            results.append(Measurement(name, "unsupported", note=note))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        err, max_abs, bad, empty = compare_errors(out.reshape(ref.shape), ref, rows)
        results.append(Measurement(name, "ok", err, max_abs, seconds, peak, empty,
                                   note=f"ref: {ref_name}" if ref_name != "naive float64" else "",
                                   valid_non_finite=bad))
        del out
    return results


def judge_synthetic(results: list[Measurement], dtype: str) -> dict[str, str]:
    """FlashAttention's rule per implementation: error <= 2 x (posdiag naive in the same dtype) + atol."""
    from posdiag.verdict import MACHINE_EPSILON

    base = next((r for r in results if r.name.startswith("posdiag naive") and r.status == "ok"), None)
    if base is None:  # long sequences: the naive score matrix does not fit; tiled (fp32 statistics) is the baseline
        base = next((r for r in results if r.name == "posdiag tiled" and r.status == "ok"), None)
    verdicts: dict[str, str] = {}
    if base is None:
        return verdicts
    atol = MACHINE_EPSILON.get(dtype, 1.2e-7)
    for r in results:
        if r.status != "ok":
            verdicts[r.name] = "n/a"
        elif r.valid_non_finite:
            verdicts[r.name] = "FAIL (NaN/Inf in rows that see keys)"
        elif r.error <= 2 * base.error + atol:
            verdicts[r.name] = "ok"
        else:
            verdicts[r.name] = f"FAIL ({r.error / max(base.error, 1e-300):.3g}x naive)"
    return verdicts


def sweep_lengths(start: int, stop: int) -> list[int]:
    lengths, n = [], start
    while n <= stop:
        lengths.append(n)
        n *= 2
    return lengths
