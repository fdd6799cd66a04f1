"""The check registry: stable names -> modules, imported only when run (keeps start-up fast).

Every check module has the same shape: a docstring saying what it proves, `TITLE`, and
`run(subject, options) -> CheckResult`. Checks never print and never exit.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Order is the order `posdiag check` runs and reports them.
REGISTRY: dict[str, str] = {
    "load": "posdiag.checks.load",
    "shuffle": "posdiag.checks.shuffle",
}

# Names reserved by the design's contract for checks that later work adds; --only/--skip
# accept them so a CI config written today keeps working.
PLANNED = ("positions", "batch", "cache", "generate", "causal", "shift", "rope", "table", "kernels")


def available() -> list[str]:
    return list(REGISTRY)


def import_check(name: str) -> ModuleType:
    return importlib.import_module(REGISTRY[name])
