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

Conventions (shared by both, by the synthetic comparison in tools/synthetic.py and by the tests):
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
from dataclasses import dataclass
from typing import Any

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
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
