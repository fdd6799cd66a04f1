"""TEMPORARY stand-in until the module-by-module engine lands: whole-model float64 conversion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class FinerRun:
    value: Any
    dtype: torch.dtype
    how: str = ""
    reason: str = ""


def run_finer(subject: Any, compute: Callable[[], Any], preferred: torch.dtype = torch.float64) -> FinerRun:
    current = subject.dtype
    if current == preferred:
        return FinerRun(compute(), preferred, "no conversion")
    subject.model.to(preferred)
    try:
        return FinerRun(compute(), preferred, "whole model converted")
    except (RuntimeError, TypeError) as exc:
        return FinerRun(None, preferred, reason=str(exc).splitlines()[0][:120])
    finally:
        subject.model.to(current)
