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

Conversion ways (WAYS), cheapest first:
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
from posdiag.model.memory import memory_allows, weight_bytes
from posdiag.model.placement import is_dispatched
from posdiag.model.subject import Subject
from posdiag.model.tensors import default_dtype, dtype_name

T = TypeVar("T")

WAYS = {"module": "one module at a time", "block": "one block at a time", "whole": "whole model converted"}
BLOCK_NAMES = ("layers", "layer", "h", "block", "blocks")  # ModuleLists that hold transformer blocks
SLICE_BYTES = 16 << 20  # the most finer-dtype weight a sliced linear layer holds at once
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


def streamed_bytes(subject: Subject, dtype: torch.dtype) -> int:
    """Bytes of the largest finer copy a streamed conversion holds at once: one block converted whole
    ("block"), else one module's own parameters ("module"), in `dtype`."""
    units = [sum(p.numel() for p in b.parameters()) for b in blocks(subject.model)]
    units += [sum(p.numel() for p in m.parameters(recurse=False)) for m in subject.model.modules()]
    return max(units, default=0) * dtype.itemsize


# ------------------------------------------------------------------------------ conversion ways
@contextlib.contextmanager
def as_dtype(model: torch.nn.Module, dtype: torch.dtype, current: torch.dtype) -> Iterator[None]:
    """Convert in place and back (exact: float32/bf16/fp16 -> float64 -> back is lossless)."""
    if dtype == current:
        yield
        return
    model.to(dtype)
    try:
        yield
    finally:
        model.to(current)


@contextlib.contextmanager
def streamed_dtype(model: torch.nn.Module, dtype: torch.dtype, per_block: bool = False) -> Iterator[None]:
    """Run in `dtype` one module at a time, so memory holds one module's finer copy instead of
    the whole model's. Each module's own floating parameters and buffers are converted when it is
    called and put back (the original storage: memory-mapped weights stay mapped) when it returns.
    Embedding outputs (a lookup is exact in any dtype) are converted
    instead of their tables; a linear layer over SLICE_BYTES converts its weight a slice of rows at
    a time. Copies go into reused buffers (_Scratch). Measured on a 125M Llama (2 CPU cores, 64
    tokens), peak RSS over a bare load + forward: 2.2x whole model, 1.7x per module, 1.3x with
    embedding/head, ~1.15x reusing buffers. A module whose weights are read outside its own
    forward (T5's feed-forward casts to its child's weight dtype) makes the matmul dtypes clash:
    per_block=True then converts each transformer block whole on entry (memory: one block's copy)."""
    streamer = _Streamer(model, dtype, per_block)
    streamer.install(model)
    try:
        yield
    finally:
        streamer.remove()


class _Streamer:
    """The hooks of one streamed_dtype conversion, and their removal."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, per_block: bool):
        self.dtype = dtype
        self.scratch = _Scratch(dtype)
        self.saved: dict[int, list] = {}
        found = blocks(model) if per_block else []
        self.whole = {id(b) for b in found}
        self.covered = {id(m) for b in found for m in b.modules() if m is not b}
        self.handles: list = []
        self.swapped: list[torch.nn.Module] = []
        self.wrapped: list = []

    def install(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if id(module) in self.covered or not self.own(module):
                continue
            accelerate_hook = getattr(module, "_hf_hook", None)  # set by accelerate's dispatch (device maps)
            if isinstance(module, torch.nn.Embedding):
                self.handles.append(module.register_forward_hook(self.embedding_output))
            elif accelerate_hook is not None:
                self.wrapped.append(self.around_accelerate(accelerate_hook))
            elif (type(module) is torch.nn.Linear and "forward" not in vars(module)
                  and module.weight.numel() * self.dtype.itemsize > SLICE_BYTES):
                module.forward = _sliced_linear(module, self.scratch)
                self.swapped.append(module)
            else:
                self.handles.append(module.register_forward_pre_hook(self.pre))
                self.handles.append(module.register_forward_hook(self.post, always_call=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module in self.swapped:
            del module.forward
        for hook in self.wrapped:
            del hook.pre_forward, hook.post_forward  # the class's methods again

    def own(self, module: torch.nn.Module) -> list[torch.Tensor]:
        recurse = id(module) in self.whole
        tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
        return [t for t in tensors if t.is_floating_point()]

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        tensors = self.own(module)
        self.saved.setdefault(id(module), []).append((tensors, [t.data for t in tensors]))
        for t in tensors:
            t.data = self.scratch.take(t.data)

    def post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        """The tensors `pre` converted get their data back. A buffer the forward replaced (a dynamic rotary's
        inv_freq, registered anew when it grows) is the module's new state: left as the forward wrote it, never
        overwritten with the old one's data (that would undo, in the float64 re-run only, what the call did)."""
        stack = self.saved.get(id(module))
        if stack:
            kept = _storages(out)
            tensors, originals = stack.pop()
            for t, original in zip(tensors, originals, strict=True):
                self.scratch.give(t.data, reusable=t.data.untyped_storage().data_ptr() not in kept)
                t.data = original

    def embedding_output(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        return out.to(self.dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    def around_accelerate(self, hook: Any) -> Any:
        """accelerate loads an offloaded module's weights inside module.forward (its hook's
        pre_forward) and drops them again in post_forward: convert after the one, restore before
        the other. Torch's own pre-hooks would see meta tensors."""
        load, unload = hook.pre_forward, hook.post_forward

        def pre_forward(module, *args, **kwargs):
            args, kwargs = load(module, *args, **kwargs)
            self.pre(module, args)
            return args, kwargs

        def post_forward(module, output):
            self.post(module, None, output)
            return unload(module, output)

        hook.pre_forward, hook.post_forward = pre_forward, post_forward
        return hook


class _Scratch:
    """Finer copies of weights in buffers reused by shape. Fresh copies freed after each module
    make glibc raise its mmap threshold and keep later copies on the heap: peak RSS crept from
    1.16x to 1.32x of a bare load + forward (125M Llama). A buffer that the module's output still
    points into is dropped, never reused."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, source: torch.Tensor) -> torch.Tensor:
        pool = self.free.get((tuple(source.shape), source.device))
        buffer = pool.pop() if pool else torch.empty(source.shape, dtype=self.dtype, device=source.device)
        return buffer.copy_(source)

    def give(self, buffer: torch.Tensor, reusable: bool = True) -> None:
        if reusable and buffer.dtype == self.dtype and buffer.is_contiguous():
            self.free.setdefault((tuple(buffer.shape), buffer.device), []).append(buffer)


def _storages(out: Any) -> set[int]:
    """Data pointers of the storages behind every tensor in a module's output."""
    found: set[int] = set()
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


def _sliced_linear(module: torch.nn.Linear, scratch: _Scratch) -> Callable[[torch.Tensor], torch.Tensor]:
    """module's forward computed in the scratch dtype from row slices of its weight (each output
    feature is one row: slicing changes no sum). The input is not converted: a dtype clash still
    surfaces."""
    weight, bias = module.weight, module.bias
    rows = max(1, SLICE_BYTES // (weight.shape[1] * scratch.dtype.itemsize))

    def forward(x: torch.Tensor) -> torch.Tensor:
        parts = []
        for i in range(0, weight.shape[0], rows):
            w = scratch.take(weight[i:i + rows])
            parts.append(torch.nn.functional.linear(x, w, None if bias is None else bias[i:i + rows].to(scratch.dtype)))
            scratch.give(w)
        return torch.cat(parts, dim=-1)

    return forward


# ------------------------------------------------------------------------------ guards of every way
def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: members of ModuleLists named as in BLOCK_NAMES."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in BLOCK_NAMES and len(module):
            found.extend(module)
    return found


@contextlib.contextmanager
def finite_padding(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """For float64 runs: transformers' eager softmax runs in float32, so finfo(float64).min
    becomes -inf and a fully masked (padding) query row turns NaN; the next layer then multiplies
    that NaN value by a zero weight at every valid query (0 · NaN = NaN). Valid queries never see
    padding keys, so zeroing non-finite values in block outputs changes no valid output."""
    if not enabled:
        yield
        return

    def hook(module, args, output):
        def clean(x):
            floating = isinstance(x, torch.Tensor) and x.is_floating_point()
            return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) if floating else x
        if isinstance(output, tuple):  # a named tuple (Reformer's block output: ReformerOutput) keeps its type
            return type(output)(clean(output[0]), *output[1:]) if hasattr(output, "_fields") \
                else (clean(output[0]), *output[1:])
        return clean(output)

    handles = [b.register_forward_hook(hook) for b in blocks(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def eager_experts(model: torch.nn.Module) -> Iterator[bool]:
    """MoE experts through transformers' eager loop: grouped_mm has no float64 kernel ("Expected
    mat_a to be Float32, BFloat16 or Float16"). Same function, other summation order, like any
    reference. Yields whether it switched; restored afterwards."""
    get = getattr(model, "get_experts_implementation", None)
    saved = get() if callable(get) else {}
    if not any(v not in (None, "eager") for v in saved.values()):
        yield False
        return
    try:
        model.set_experts_implementation("eager")
    except Exception:  # the class cannot switch: the reference runs as the model is
        yield False
        return
    try:
        yield True
    finally:
        model.set_experts_implementation(saved)
