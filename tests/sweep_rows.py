"""Parameters of exhaustive per-model-type tests: which rows are the core and which are repetition.

`exhaustive(values, always=...)` marks every value not in `always` with `sweep`. Every row runs in every run (the
whole suite is the same on any day); the marker only names the repetition, so `-m "not sweep"` is a quicker run over
the core rows and `-m sweep` runs the repetition alone. The ids are the plain values', so a row keeps its name either
way. Keep in `always` one row per kind and position scheme, and every row that pins a finding (an upstream bug, a
SKIP with a named reason).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# One zoo family per (kind, position scheme) the checks treat differently: RoPE, learned, ALiBi, sliding window,
# encoder, encoder-decoder with relative buckets and with a sinusoidal table.
CORE_FAMILIES = frozenset({"llama", "gpt2", "bloom", "mistral", "gemma2", "bert", "modernbert", "t5", "marian"})


def exhaustive(values: Iterable, always: Iterable = CORE_FAMILIES) -> list:
    keep = set(always)
    return [v if v in keep else pytest.param(v, marks=pytest.mark.sweep) for v in values]
