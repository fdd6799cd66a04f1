"""casts — keep a float64 run in float64 where the model's own code casts down to float32.

transformers' norms cast their input to float32 (LlamaRMSNorm: `hidden_states.to(torch.float32)`) and its eager
attention takes the softmax with `dtype=torch.float32`. In a float64 run (posdiag.model.precision) those casts keep
float32 rounding inside: measured on a Llama without positions (8 layers x 256 hidden, 256 tokens), the shuffle
residual is 4.6e-6 in float32 and still 9.3e-7 in float64 (a factor 5), so float64 cannot tell rounding from a weak
position signal. Inside `float64_throughout()` a cast of a float64 tensor to float32 keeps float64: the same residual
is then 1.0e-14 (its healthy twin keeps 1.38). Casts of other dtypes, and every other op, are untouched.

Rotary angles are the other float32 left in a float64 run: transformers' rotary modules cast the integer position ids
with an explicit `.float()` before multiplying by inv_freq, so the angle m·θ keeps a float32 error (~m·6e-8) that a
float64 rounding bound does not allow for. Measured: a healthy default-init Llama (4 layers x 128 hidden, θ 5e5,
context 131072) FAILed `shift` "decided in float64" under `--dtype bfloat16 --no-upcast` at 140x its bound at shift
131008 (and PASSed in float32). Inside `float64_angles(model)` an integer tensor cast to float32 within a rotary
module's forward becomes float64 (positions are exact there); the same rung is then 0.7x. A rotary module that reads
its angles from a stored table (GPT-J's sin/cos table, built in float32) keeps that table's rounding: Angles says so,
and the caller bounds its rounding with float32's epsilon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_F = torch.nn.functional
_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_SOFTMAX = {torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, _F.softmax,
            _F.log_softmax}


class _KeepFloat64(TorchFunctionMode):
    def __init__(self, angles: Angles | None = None):
        super().__init__()
        self.angles = angles

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if self.angles is not None and self.angles.inside and isinstance(first, torch.Tensor) \
                and (first.dtype == torch.float32 or not first.is_floating_point()) and not first.is_complex():
            # positions (integers) and, beside them, the float32 frequencies both go to float64: transformers 5.17
            # multiplies `inv_freq.to(dtype=torch.float)` by the positions with a matmul, which refuses a mix
            func, args, kwargs = self.angles.finer_cast(func, args, kwargs, positions=not first.is_floating_point())
        if func in _PRODUCTS and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]) \
                and {args[0].dtype, args[1].dtype} == {torch.float32, torch.float64}:
            # one side kept in float64, the other cast by the model's code: transformers 5.17's rotary multiplies
            # `inv_freq.to(float)` by `position_ids.float()` with a matmul, which refuses the mix; 5.25's `*` promotes
            args = (args[0].double(), args[1].double(), *args[2:])
        if isinstance(first, torch.Tensor) and first.dtype == torch.float64:
            if func is torch.Tensor.float:
                return first
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if func in (torch.Tensor.to, *_SOFTMAX) and kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Within the block, float64 tensors are never cast down to float32 (norms, softmax, rotary tables)."""
    with _KeepFloat64():
        yield


@dataclass
class Angles:
    """What float64_angles saw: the rotary modules whose angles ran in float64 (`computed`), and those that ran
    without an integer cast to upgrade (`kept`: a stored table, or angle code posdiag cannot reach)."""

    computed: set[str] = field(default_factory=set)
    ran: set[str] = field(default_factory=set)
    stack: list[str] = field(default_factory=list)

    @property
    def inside(self) -> bool:
        return bool(self.stack)

    tables: dict[str, torch.dtype] = field(default_factory=dict)

    @property
    def kept(self) -> list[str]:
        return sorted(self.ran - self.computed)

    @property
    def kept_dtype(self) -> torch.dtype | None:
        """The coarsest precision the kept modules' tables hold (None: every angle ran in float64)."""
        held = [self.tables.get(name, torch.float32) for name in self.kept]
        return min(held, key=lambda d: -torch.finfo(d).eps) if held else None

    def leave(self, name: str, module: torch.nn.Module) -> None:
        if self.stack:
            self.stack.pop()
        if name not in self.computed:
            self.tables[name] = stored_precision(module)

    def finer_cast(self, func, args: tuple, kwargs: dict, positions: bool = True) -> tuple[Any, tuple, dict]:
        """A tensor cast to float32 inside a rotary module: cast to float64 instead (exact for integer positions; a
        float32 table keeps its rounding, so only an integer cast counts the module's angles as computed)."""
        if func is torch.Tensor.float:
            if positions:
                self.computed.add(self.stack[-1])
            return torch.Tensor.double, args, kwargs
        if func in (torch.Tensor.to, torch.Tensor.type) and (torch.float32 in args[1:] or
                                                               kwargs.get("dtype") is torch.float32):
            if positions:
                self.computed.add(self.stack[-1])
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func, args, kwargs


def rotary_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that turn positions into rotations: a class named *Rotary* or an inv_freq buffer of its own."""
    return {name: m for name, m in model.named_modules()
            if "rotary" in type(m).__name__.lower() or any(n.endswith("inv_freq") for n in m._buffers)}


def stored_precision(module: torch.nn.Module) -> torch.dtype:
    """The coarsest of bfloat16, float16, float32 that holds every floating buffer of the module exactly (a table
    cast to bfloat16 and back still holds only bfloat16's precision); float64 when none does."""
    values = [b for b in module.buffers(recurse=False) if b.is_floating_point()]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if values and all(torch.equal(b, b.to(dtype).to(b.dtype)) for b in values):
            return dtype
    return torch.float64 if values else torch.float32


@contextlib.contextmanager
def float64_angles(model: torch.nn.Module) -> Iterator[Angles]:
    """float64_throughout, and within each rotary module's forward integer position ids cast to float32 become
    float64, so the angles m·θ are computed in float64. Yields Angles (filled while the block runs)."""
    angles = Angles()
    handles = []
    for name, module in rotary_modules(model).items():
        def enter(_m, _args, name=name):
            angles.ran.add(name)
            angles.stack.append(name)

        def leave(m, _args, _out, name=name):
            angles.leave(name, m)
        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with _KeepFloat64(angles):
            yield angles
    finally:
        for handle in handles:
            handle.remove()
