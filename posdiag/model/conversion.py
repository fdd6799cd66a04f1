"""The ways a model computes in a finer dtype (posdiag.model.precision chooses among them), and the guards every
way runs under.

- whole: the model converted in place and back (as_dtype: exact both ways);
- streamed: one module (or one transformer block) at a time, its own weights converted on entry and given back
  on exit (streamed_dtype), so memory holds one module's finer copy;
- guards: MoE experts through transformers' eager loop (eager_experts), non-finite block outputs zeroed in float64
  (finite_padding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

BLOCK_NAMES = ("layers", "layer", "h", "block", "blocks")  # ModuleLists that hold transformer blocks
SLICE_BYTES = 16 << 20  # the most finer-dtype weight a sliced linear layer holds at once


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
def retyped(model: torch.nn.Module, source: torch.dtype, target: torch.dtype) -> Iterator[int]:
    """Inside the block, exactly the parameters and buffers stored in `source` are held in `target`; on exit they are
    put back (exact: a bfloat16 or float16 value is a float32 value). Unlike `model.to`, a tensor kept in another
    dtype on purpose stays so (a float32 `inv_freq` in a bfloat16 model is never rounded to bfloat16 on the way
    back), and a parameter tied to another (an embedding and its LM head) stays one tensor. Yields the bytes
    converted, in `source`."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and tensor.dtype == source and id(tensor) not in seen:
                seen[id(tensor)] = tensor
    with torch.no_grad():
        for tensor in seen.values():
            tensor.data = tensor.data.to(target)
        try:
            yield sum(t.numel() for t in seen.values()) * source.itemsize
        finally:
            for tensor in seen.values():
                tensor.data = tensor.data.to(source)


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
