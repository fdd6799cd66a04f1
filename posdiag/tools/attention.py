"""Reference attention: posdiag's own naive (float64) and tiled online-softmax implementations.

Both are written from the definition, not from any kernel's code.

naive:  O = softmax(Q Kᵀ · scale + mask) V, the whole score matrix at once, in float64.
tiled:  the FlashAttention derivation. Keys are visited in blocks; per query row keep a running
        max m, a running sum l and an unnormalised accumulator acc (all float32, whatever the
        input dtype). For a new block with scores S:
            m' = max(m, rowmax S);  P = exp(S − m');  α = exp(m − m')
            l' = α·l + rowsum P;    acc' = α·acc + P V
        and O = acc / l at the end. exp(m − m') rescales what was summed under the old max, so
        the result equals softmax exactly in exact arithmetic: tiling changes only the order of
        the sums. Memory is O(T·block) instead of O(T²): the mask is built per tile as well.

Conventions (shared by both, by the synthetic comparison and by the tests):
- q [B, H, Tq, D], k and v [B, Hkv, Tk, D]; H % Hkv == 0 and query head h reads kv head
  h // (H / Hkv) (grouped-query attention, as `repeat_kv` / SDPA `enable_gqa`).
- `MaskSpec` describes which keys a query may see without materialising a [Tq, Tk] mask:
  causal with "top_left" alignment (query i sits at position i: SDPA's `is_causal`) or
  "bottom_right" (query i sits at i + Tk − Tq: a chunk of new tokens against a KV cache,
  FlashAttention ≥ 2.1); a key padding mask; a sliding window (a causal query sees the
  `window` most recent keys, itself included: q − k < window; bidirectional: |q − k| < window).
- A query row that may see no key at all (left padding, a window past every key, or
  bottom-right alignment with Tq > Tk) outputs 0 here; `rows_with_keys` says which rows those are.
  Kernels differ on what they put there (0, NaN, a uniform average): that is reported, not judged.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

ALIGNMENTS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may see. key_valid: bool [B, Tk] (False at padding) or None."""

    q_len: int
    k_len: int
    causal: bool = False
    alignment: str = "top_left"
    window: int | None = None
    key_valid: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {ALIGNMENTS}, not {self.alignment!r}")
        if self.window is not None and self.window < 1:
            raise ValueError("window must be at least 1")

    @property
    def offset(self) -> int:
        """Position of query 0 (keys sit at 0..Tk-1)."""
        return self.k_len - self.q_len if self.alignment == "bottom_right" else 0

    @property
    def is_full(self) -> bool:
        return not self.causal and self.window is None and self.key_valid is None

    def block(self, q0: int, q1: int, k0: int, k1: int, device: Any = "cpu") -> torch.Tensor | None:
        """bool [B or 1, 1, q1-q0, k1-k0] (True = may attend), or None when every pair may."""
        if self.is_full:
            return None
        qp = torch.arange(q0, q1, device=device)[:, None] + self.offset
        kp = torch.arange(k0, k1, device=device)[None, :]
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= kp <= qp
        if self.window is not None:
            allowed &= ((qp - kp) < self.window) if self.causal else ((qp - kp).abs() < self.window)
        allowed = allowed[None, None]
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, None, k0:k1].to(device).bool()
        return allowed

    def dense(self, device: Any = "cpu") -> torch.Tensor:
        """The whole bool mask [B or 1, 1, Tq, Tk] (quadratic memory: for references and SDPA)."""
        m = self.block(0, self.q_len, 0, self.k_len, device)
        if m is None:
            m = torch.ones(1, 1, self.q_len, self.k_len, dtype=torch.bool, device=device)
        return m

    def rows_with_keys(self, device: Any = "cpu") -> torch.Tensor:
        """bool [B or 1, 1, Tq]: query rows that may see at least one key."""
        return self.dense(device).any(-1)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = x.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    return x if kv_heads == heads else x.repeat_interleave(heads // kv_heads, dim=1)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec | None = None,
                    scale: float | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """softmax(Q Kᵀ·scale + mask) V in `dtype` (float64: the reference), the full score matrix at once.

    Rows that see no key give 0. Returns [B, H, Tq, D] in `dtype`.
    """
    spec = spec or MaskSpec(q.shape[-2], k.shape[-2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads = q.shape[1]
    qf, kf, vf = q.to(dtype), _expand_kv(k, heads).to(dtype), _expand_kv(v, heads).to(dtype)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = spec.block(0, spec.q_len, 0, spec.k_len, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 at masked keys
    denom = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights, vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec | None = None,
                    scale: float | None = None, block_q: int = 128, block_k: int = 128) -> torch.Tensor:
    """Online-softmax attention over key blocks (see the module docstring), statistics in float32.

    Low-precision inputs follow FlashAttention: Q Kᵀ accumulated in float32, P rounded to the
    input dtype before P V (accumulated in float32), the output cast back to the input dtype.
    float64 inputs run entirely in float64 (to show the algorithm itself is exact).
    Tiles that the mask blocks entirely are skipped, as a fused kernel does.
    """
    spec = spec or MaskSpec(q.shape[-2], k.shape[-2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    in_dtype = q.dtype
    acc_dtype = torch.float64 if in_dtype == torch.float64 else torch.float32
    low = in_dtype in (torch.float16, torch.bfloat16)
    b, heads, tq, d = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    # GQA without copying k/v: view queries as [B, Hkv, group, Tq, D].
    qg = q.reshape(b, kv_heads, group, tq, d)
    out = torch.empty(b, kv_heads, group, tq, v.shape[-1], dtype=in_dtype, device=q.device)
    for q0 in range(0, tq, block_q):
        q1 = min(tq, q0 + block_q)
        qb = qg[:, :, :, q0:q1].to(acc_dtype)
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=acc_dtype, device=q.device)
        for k0 in range(0, tk, block_k):
            k1 = min(tk, k0 + block_k)
            allowed = spec.block(q0, q1, k0, k1, q.device)
            if allowed is not None and not bool(allowed.any()):
                continue  # a tile the mask blocks entirely
            kb = k[:, :, None, k0:k1].to(acc_dtype)
            vb = v[:, :, None, k0:k1]
            s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
            if allowed is not None:
                s = s.masked_fill(~allowed[:, :, None], float("-inf"))  # [B,1,1,bq,bk] over (Hkv, group)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)  # exp(-inf) = 0 on the first visible block
            l = alpha * l + p.sum(-1)
            pv = (p.to(in_dtype) if low else p).to(acc_dtype)
            acc = alpha[..., None] * acc + torch.matmul(pv, vb.to(acc_dtype))
            m = m_new
        safe_l = torch.where(l > 0, l, torch.ones_like(l))
        out[:, :, :, q0:q1] = (acc / safe_l[..., None]).to(in_dtype)
    return out.reshape(b, heads, tq, v.shape[-1])


# ============================================================================ SDPA backends
def sdpa_backends(device: torch.device | str) -> list[str]:
    """torch.nn.attention SDPA backends worth trying on this device type."""
    dev = torch.device(device).type
    if dev == "cuda":
        return ["flash", "efficient", "cudnn", "math"]
    return ["math", "flash"]  # the CPU flash kernel is selected through FLASH_ATTENTION too


def run_sdpa(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
             scale: float | None = None) -> torch.Tensor:
    """One SDPA call pinned to one backend. The mask goes in the cheapest form the spec allows:
    none, is_causal (top-left, or Tq == Tk), the lower-right causal bias, else a dense bool mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    pinned = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    kwargs: dict[str, Any] = {"scale": scale}
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    plain_causal = spec.causal and spec.window is None and spec.key_valid is None
    if spec.is_full:
        mask, is_causal = None, False
    elif plain_causal and (spec.alignment == "top_left" or spec.q_len == spec.k_len):
        mask, is_causal = None, True
    elif plain_causal and spec.q_len <= spec.k_len:
        from torch.nn.attention.bias import causal_lower_right

        mask, is_causal = causal_lower_right(spec.q_len, spec.k_len), False
    else:
        mask, is_causal = spec.dense(q.device), False
    with sdpa_kernel([pinned]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)


# ============================================================================ synthetic comparison
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


def _measure(fn: Callable[[], torch.Tensor], device: torch.device, memory: bool, repeats: int) -> tuple[torch.Tensor, float, int | None]:
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
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.3 * free)
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
        ref = tiled_attention(q.double(), k.double(), v.double(), spec, block_q=reference_block, block_k=reference_block)
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
        results.append(Measurement(name, "ok", err, max_abs, seconds, peak, empty, note=f"ref: {ref_name}" if ref_name != "naive float64" else "",
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
