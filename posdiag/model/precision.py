"""precision — one engine for running any computation on a model in a finer dtype.

Rounding shrinks by ~1e8 from float32 to float64; a bug does not. So a finer run of the same
function is the yardstick for every comparison that must agree "within rounding": the `kernels`
check's reference (FlashAttention's rule needs one more precise than the tested dtype), the noise
floor of `posdiag compare`, and float64 arbitration of any two computations (a KV-cache
continuation vs the full forward, generate vs forward) whose difference an fp32 tolerance cannot
decide. The computation (a forward, a cache continuation, generate) runs as the caller wrote it;
only the model's weights are seen in the finer dtype while it runs.

    run_finer(subject, compute, preferred)   compute() in `preferred` (float32 when that is still finer
                                             than the run dtype), trying the ways in order; restored
    finer_dtype(subject, dtype, how)         one conversion way, as a context manager
    reference_dtype(subject)                 float64 where a conversion fits in memory, else float32, else none
    memory_allows(subject, extra, fraction)  the one memory-budget rule of posdiag (posdiag.model.memory)

Conversion ways (WAYS, posdiag.model.conversion), cheapest first:
- "module": one module at a time (streamed_dtype: never a whole finer copy; embedding tables and
  the LM head are not copied whole either). Works on accelerate-dispatched (offloaded) models too.
- "block": each transformer block converted whole on entry, for modules whose weights are read
  outside their own forward (T5's feed-forward casts to its child's weight dtype).
- "whole": the whole model converted in place and back (exact: float32/bf16/fp16 -> float64 ->
  back is lossless). Not on a dispatched model: accelerate refuses to move it.
Every way runs MoE experts through transformers' eager loop (grouped_mm has no float64 kernel) and,
in float64, zeroes non-finite values in block outputs (finite_padding: a fully masked padding row
turns NaN when transformers' eager softmax runs in float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from posdiag.errors import one_line
from posdiag.model.conversion import (
    BLOCK_NAMES,
    SLICE_BYTES,
    as_dtype,
    blocks,
    eager_experts,
    finite_padding,
    streamed_dtype,
)
from posdiag.model.memory import memory_allows, weight_bytes
from posdiag.model.placement import is_dispatched
from posdiag.model.subject import Subject
from posdiag.model.tensors import default_dtype, dtype_name

__all__ = ["BLOCK_NAMES", "REFERENCE_FRACTION", "SLICE_BYTES", "WAYS", "WHOLE_FRACTION", "FinerRun", "as_dtype",
           "blocks", "conversion_ways", "eager_experts", "everywhere_at_least", "finer_dtype", "finite_padding",
           "float32_copy_refused",
           "memory_allows", "reference_dtype", "run_finer", "streamed_bytes", "streamed_dtype", "weight_bytes"]

T = TypeVar("T")

WAYS = {"module": "one module at a time", "block": "one block at a time", "whole": "whole model converted"}
REFERENCE_FRACTION = {"cuda": 0.5, "cpu": 0.4}  # of free memory a reference copy may take (reference_dtype)
WHOLE_FRACTION = 0.8  # of free memory a whole finer copy may take (the "whole" way)


@dataclasses.dataclass(frozen=True)
class FinerRun(Generic[T]):
    """What run_finer gives back: the value computed in `dtype` and how the model was converted,
    or (value None) the reason nothing finer ran."""

    value: T | None
    dtype: torch.dtype
    how: str = ""
    reason: str = ""

    @property
    def ran(self) -> bool:
        return not self.reason


def run_finer(subject: Subject, compute: Callable[[], T], preferred: torch.dtype = torch.float64, *,
              reached: Callable[[T, torch.dtype], bool] | None = None, guard_padding: bool = True,
              what: str = "computation", prefer: str | None = None) -> FinerRun[T]:
    """compute() with the model's weights in `preferred`, restored exactly afterwards.

    Tries the conversion ways in order (module, block, whole; only module on a dispatched model).
    A model with an op that has no kernel in `preferred` (RuntimeError/TypeError) falls back to
    float32 when that is still finer than the run dtype (a bf16 model). `reached(value, dtype)`, when
    given, says whether the conversion reached the computation (else the next way is tried; e.g.
    everywhere_at_least; none by default: code may cast to float32 on purpose). `preferred` equal to
    the run dtype runs compute() unconverted.
    `prefer`: a way tried first where it can run ("whole" for a compiled forward: streamed hooks break its graph).
    `what` names the computation in the reason given when nothing finer runs. An attempt that raised
    stopped at the first op without a kernel: its passes are not counted in subject.forward_count."""
    if preferred == subject.dtype:
        with finite_padding(subject.model, guard_padding and preferred == torch.float64):
            return FinerRun(compute(), preferred, "no conversion")
    candidates = [preferred] + [d for d in (torch.float32,) if preferred.itemsize > d.itemsize > subject.dtype.itemsize]
    failure = ""
    for dtype in candidates:  # last resort: torch's default dtype too, for constants the model builds in it
        ways = conversion_ways(subject, dtype)
        order = (prefer, *(w for w in ways if w != prefer)) if prefer in ways else ways
        for how, default in [(how, None) for how in order] + [(ways[-1], dtype)]:
            passes = subject.forward_count
            try:
                with finer_dtype(subject, dtype, how, guard_padding=guard_padding) as done, default_dtype(default):
                    value = compute()
                if reached is None or reached(value, dtype):
                    return FinerRun(value, dtype, done + (", as torch's default dtype too" if default else ""))
                failure = f"{dtype_name(dtype)}: the conversion did not reach every module"
            except (RuntimeError, TypeError) as exc:
                subject.forward_count = passes
                failure = f"{dtype_name(dtype)}: {one_line(exc)[:120]}"
    where = ("this offloaded model (run it where the model fits in memory)" if is_dispatched(subject.model)
             else "this model")
    return FinerRun(None, preferred,
                    reason=f"no {what} more precise than {subject.dtype_name} runs on {where}: {failure}")


def conversion_ways(subject: Subject, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The ways (keys of WAYS) that can convert this model, in the order to try them: "whole" only where
    a whole copy in `dtype` fits (WHOLE_FRACTION of free memory; the streamed ways hold one block's)."""
    if is_dispatched(subject.model):
        return ("module",)
    if dtype is not None and not memory_allows(subject, weight_bytes(subject, dtype), WHOLE_FRACTION):
        return ("module", "block")
    return tuple(WAYS)


@contextlib.contextmanager
def finer_dtype(subject: Subject, dtype: torch.dtype, how: str, *, guard_padding: bool = True) -> Iterator[str]:
    """Inside the block the model computes in `dtype`, converted by way `how` (a key of WAYS), with
    MoE experts in the eager loop and (float64, guard_padding) non-finite block outputs zeroed.
    Yields how, in words; everything is restored on exit."""
    if how not in WAYS:
        raise ValueError(f"how must be one of {tuple(WAYS)}, not {how!r}")
    model = subject.model
    converted = (as_dtype(model, dtype, subject.dtype) if how == "whole"
                 else streamed_dtype(model, dtype, per_block=how == "block"))
    with eager_experts(model) as experts, converted, finite_padding(model, guard_padding and dtype == torch.float64):
        yield WAYS[how] + ("; MoE experts through the eager loop" if experts else "")


def everywhere_at_least(value: Any, dtype: torch.dtype) -> bool:
    """Every floating tensor in value (through tuples, lists, dicts, model outputs and dataclasses)
    is at least as precise as dtype."""
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.dtype.itemsize < dtype.itemsize:
                return False
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return True


# ------------------------------------------------------------------------------ memory
def reference_dtype(subject: Subject) -> torch.dtype:
    """float64 where the finer copy a streamed conversion holds fits (REFERENCE_FRACTION of free memory),
    else float32, else the run dtype itself (also on devices other than CPU and CUDA). Budgeting a copy of
    every weight instead denied float64 to a 90k-parameter language model for the 690M parameters of
    towers its forward never runs (VibeVoice-ASR's tokenizers), and the reference became eager itself."""
    fraction = REFERENCE_FRACTION.get(subject.device.type)
    for dtype in (torch.float64, torch.float32):
        if dtype.itemsize <= subject.dtype.itemsize:
            return subject.dtype
        if fraction is not None and memory_allows(subject, streamed_bytes(subject, dtype), fraction):
            return dtype
    return subject.dtype


def float32_copy_refused(subject: Subject) -> str:
    """Why half-precision weights cannot be held in float32 for a check (posdiag.half_precision; "" when they
    can): the float32 copy replaces the stored one in place, so it needs the difference in free memory."""
    if is_dispatched(subject.model):
        return "a model dispatched by accelerate cannot be re-cast in place"
    extra = weight_bytes(subject, torch.float32) - weight_bytes(subject, subject.dtype)
    if not memory_allows(subject, extra, WHOLE_FRACTION):
        return f"not enough free memory for the weights in float32 ({extra / 2**30:.2f} GiB more)"
    return ""


def streamed_bytes(subject: Subject, dtype: torch.dtype) -> int:
    """Bytes of the largest finer copy a streamed conversion holds at once: one block converted whole
    ("block"), else one module's own parameters ("module"), in `dtype`."""
    units = [sum(p.numel() for p in b.parameters()) for b in blocks(subject.model)]
    units += [sum(p.numel() for p in m.parameters(recurse=False)) for m in subject.model.modules()]
    return max(units, default=0) * dtype.itemsize
