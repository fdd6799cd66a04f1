"""casts — keep a float64 run in float64 where the model's own code casts down to float32.

transformers' norms cast their input to float32 (LlamaRMSNorm: `hidden_states.to(torch.float32)`) and its eager
attention takes the softmax with `dtype=torch.float32`. In a float64 run (posdiag.model.precision) those casts keep
float32 rounding inside: measured on a Llama without positions (8 layers x 256 hidden, 256 tokens), the shuffle
residual is 4.6e-6 in float32 and still 9.3e-7 in float64 (a factor 5), so float64 cannot tell rounding from a weak
position signal. Inside `float64_throughout()` a cast of a float64 tensor to float32 keeps float64: the same residual
is then 1.0e-14 (its healthy twin keeps 1.38). Casts of other dtypes, and every other op, are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_F = torch.nn.functional
_SOFTMAX = {torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, _F.softmax,
            _F.log_softmax}


class _KeepFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
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
