"""The check registry: stable names -> modules, imported only when run (keeps start-up fast).

Every check module has the same shape: a docstring saying what it proves, `TITLE`, and
`run(subject, options) -> CheckResult`. Checks never print and never exit.

ORDER is the contract's list of check names, in the order `posdiag check` runs them. A name
whose module `posdiag/checks/<name>.py` exists is available; the others are accepted by
--only/--skip (so a CI config written today keeps working) and reported as not implemented.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# `fit` runs after `rope`: once the rotation is known to follow the config, the question left is whether the
# weights were trained with that config (a port can get both the code and the config wrong in agreement).
ORDER = ("load", "shuffle", "positions", "batch", "cache", "generate", "causal", "shift", "rope", "fit", "table",
         "kernels")


def available() -> list[str]:
    return [name for name in ORDER if importlib.util.find_spec(f"posdiag.checks.{name}") is not None]


def import_check(name: str) -> ModuleType:
    return importlib.import_module(f"posdiag.checks.{name}")
