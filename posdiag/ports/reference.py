"""The reference run as every comparison runs it: one forward of one stack, and the same model again in a finer
dtype (its own rounding: the noise floor every port is judged against)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from posdiag.errors import PosdiagError
from posdiag.model.precision import memory_allows, run_finer, weight_bytes
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Outputs, Subject


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


T = TypeVar("T")
FINER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}


def run_stack(subject: Subject, ids: torch.Tensor, stack: str, role: str) -> Outputs:
    try:
        return run_rows(subject, [Row(ids.to(subject.device))], stack=stack, explicit_mask=False, want_logits=True)
    except PosdiagError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        declared = subject.max_positions
        hint = (f" (past its declared context of {declared}: a position table has no rows there)"
                if declared and ids.numel() > declared else "")
        raise PosdiagError(f"the {role} failed on {ids.numel()} tokens: "
                           f"{type(exc).__name__}: {text[:200]}{hint}") from None


def finer_run(subject: Subject, ids: torch.Tensor, stack: str) -> tuple[Outputs | None, str]:
    """Run `subject` once more in a finer dtype (posdiag.model.precision: module by module, restored exactly)."""
    row = [Row(ids.to(subject.device))]
    return finer_of(subject, lambda: run_rows(subject, row, stack=stack, explicit_mask=False, want_logits=True))


def finer_of(subject: Subject, compute: Callable[[], T]) -> tuple[T | None, str]:
    """compute() once more with the weights in the finer dtype (FINER), and the floor source's words; None and why
    not where it cannot run (no finer dtype, a dispatched model, no memory, an op without a kernel)."""
    dtype = next(iter(subject.model.parameters())).dtype
    finer = FINER.get(dtype)
    reason = None
    if finer is None:
        reason = f"{name_of(dtype)} has no finer dtype to compare with"
    elif subject.options.device_map:
        reason = "a --device-map model is not re-cast"
    elif not memory_allows(subject, weight_bytes(subject, finer), 0.8):
        reason = f"not enough free memory for a {name_of(finer)} copy of the weights"
    if reason is None:
        try:
            got = run_finer(subject, compute, finer, what="run")
        except Exception as exc:  # some families refuse float64: fall back to the dtype minimum
            reason = f"{name_of(finer)} run failed ({type(exc).__name__})"
        else:
            if got.ran:
                return got.value, f"{subject.spec} run in {name_of(got.dtype)} vs {name_of(dtype)} (its own rounding)"
            reason = got.reason
    return None, f"estimated: {name_of(dtype)} machine epsilon x layer index ({reason})"
