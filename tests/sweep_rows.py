"""Parameters of exhaustive per-model-type tests: the rows that run every time, the others rotating.

`rotating(values, always=...)` marks every value not in `always` with `sweep`: tests/conftest.py runs a rotating
seventh of those rows per run (every row within a week of daily runs; all of them with `-m sweep`). The ids are the
plain values', so a row keeps its name whether it rotates or not. Keep in `always` one row per kind and position
scheme, and every row that pins a finding (an upstream bug, a SKIP with a named reason).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# One zoo family per (kind, position scheme) the checks treat differently: RoPE, learned, ALiBi, sliding window,
# encoder, encoder-decoder with relative buckets and with a sinusoidal table.
CORE_FAMILIES = frozenset({"llama", "gpt2", "bloom", "mistral", "gemma2", "bert", "modernbert", "t5", "marian"})


def rotating(values: Iterable, always: Iterable = CORE_FAMILIES) -> list:
    keep = set(always)
    return [v if v in keep else pytest.param(v, marks=pytest.mark.sweep) for v in values]
