"""The check registry: one `CheckSpec` per check, verified when its module is imported.

A check is one module (or package) `posdiag/checks/<name>.py` that declares, at its top,

    SPEC = CheckSpec(name="<name>", title="...", proves="what a PASS proves, in one line",
                     applies_to=("causal", "encoder", "seq2seq"), options={...}, baseline={...})

and defines `run(subject, options) -> CheckResult`. REGISTRY lists the names in the order `posdiag check` runs
them; it is the one list (ORDER is it, `--only/--skip/--require` accept exactly these names). Modules are imported
only when asked for (start-up stays fast); `registered(name)` verifies the module the way pluggy verifies a hook
implementation: a module that breaks the contract raises `CheckContractError` naming the module and what is
missing, before anything runs. Checks never print and never exit.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from posdiag.errors import PosdiagError
from posdiag.options import Option
from posdiag.results import CheckResult, Status, Table

__all__ = ["KINDS", "ORDER", "REGISTRY", "CheckContractError", "CheckSpec", "Option", "available", "import_check",
           "registered", "spec", "validate_tables"]

# `fit` runs after `rope`: once the rotation is known to follow the config, the question left is whether the
# weights were trained with that config (a port can get both the code and the config wrong in agreement).
REGISTRY = ("load", "shuffle", "positions", "batch", "cache", "generate", "state", "serving", "causal", "shift", "rope",
            "fit", "table", "kernels")
ORDER = REGISTRY  # the contract's name for the same tuple
KINDS = ("causal", "encoder", "seq2seq")  # Subject.kind values
DIRECTIONS = ("higher", "lower")  # which way a baseline metric may move without regressing
# Tables in [checks.*] that are not checks but read `RunOptions.for_check` all the same: name -> module with OPTIONS.
OTHER_TABLES = {"compare": "posdiag.ports.layers"}


# The functions here share the package's namespace with the check modules (importing posdiag.checks.load sets
# `posdiag.checks.load`): none may take a check's name.


class CheckContractError(TypeError):
    """A check module does not have what a check must have (a posdiag bug, found on import, not mid-run)."""


@dataclass(frozen=True)
class CheckSpec:
    """What a check is, declared once at the top of its module.

    name:       the stable name (JSON, JUnit, --only/--skip); equals the module's name.
    title:      a few words for reports and `posdiag check --list`.
    proves:     what a PASS proves, one line.
    applies_to: the model kinds it judges (Subject.kind); on the others it is N/A, with its own reason.
    options:    the `[checks.NAME]` settings it reads, each with its default and the reason for it.
    baseline:   metrics `--baseline` watches, with the direction that is good ("higher" | "lower").
    run:        `run(subject, options) -> CheckResult`, bound by the registry from the module.
    """

    name: str
    title: str
    proves: str
    applies_to: tuple[str, ...] = KINDS
    options: Mapping[str, Option] = field(default_factory=dict)
    baseline: Mapping[str, str] = field(default_factory=dict)
    run: Callable[..., Any] | None = None

    def applies(self, kind: str) -> bool:
        return kind in self.applies_to

    def setting(self, options: Any, key: str) -> Any:
        """The `[checks.NAME]` value of a declared option (RunOptions.for_check), else its declared default."""
        return options.for_check(self.name).get(key, self.options[key].default)

    def result(self, status: Status, summary: str, metrics: dict[str, Any] | None = None,
               details: dict[str, Any] | None = None, tables: Iterable[Table] = ()) -> CheckResult:
        """This check's result: the name comes from the spec, so a module never spells it again."""
        return CheckResult(self.name, status, summary, {} if metrics is None else metrics,
                           {} if details is None else details, tuple(tables))


def available() -> list[str]:
    """Registered names whose module exists (a name without one is reported as not implemented)."""
    return [name for name in REGISTRY if importlib.util.find_spec(f"posdiag.checks.{name}") is not None]


def import_check(name: str) -> ModuleType:
    """The check's module, verified (CheckContractError when it breaks the contract)."""
    module = importlib.import_module(f"posdiag.checks.{name}")
    verify(module, name)
    return module


def registered(name: str) -> CheckSpec:
    """The verified spec of a registered check, with `run` bound."""
    module = import_check(name)
    return replace(module.SPEC, run=module.run)


def spec(name: str) -> CheckSpec | None:
    """The spec of a registered check that exists, else None."""
    return registered(name) if name in available() else None


def verify(module: ModuleType, name: str) -> None:
    """Every field a check must declare, each with a precise error (the model: pluggy's _verify_hook)."""
    where = module.__name__

    def broken(what: str) -> CheckContractError:
        return CheckContractError(f"check module {where}: {what}")

    if name not in REGISTRY:
        raise broken(f"'{name}' is not in posdiag.checks.REGISTRY (add it there, in run order)")
    spec_ = getattr(module, "SPEC", None)
    if not isinstance(spec_, CheckSpec):
        raise broken("no module-level `SPEC = CheckSpec(...)`" if spec_ is None
                     else f"SPEC is a {type(spec_).__name__}, not a CheckSpec")
    if spec_.name != name:
        raise broken(f"SPEC.name is '{spec_.name}', the module is '{name}'")
    for attr in ("title", "proves"):
        value = getattr(spec_, attr)
        if not isinstance(value, str) or not value.strip() or "\n" in value:
            raise broken(f"SPEC.{attr} must be one non-empty line")
    if not spec_.applies_to or set(spec_.applies_to) - set(KINDS):
        raise broken(f"SPEC.applies_to {spec_.applies_to!r}: name one or more of {', '.join(KINDS)}")
    for key, option in spec_.options.items():
        if not isinstance(option, Option) or not option.why.strip():
            raise broken(f"SPEC.options['{key}'] must be an Option(default, why)")
    for metric, direction in spec_.baseline.items():
        if direction not in DIRECTIONS:
            raise broken(f"SPEC.baseline['{metric}'] is '{direction}': use one of {', '.join(DIRECTIONS)}")
    _verify_run(getattr(module, "run", None), broken)


def _verify_run(run: Any, broken: Callable[[str], CheckContractError]) -> None:
    if not callable(run):
        raise broken("no `run(subject, options) -> CheckResult` function")
    params = [p for p in inspect.signature(run).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty]
    if len(params) < 2 or len(required) > 2:
        raise broken(f"run{inspect.signature(run)} must take (subject, options)")


def schema(name: str) -> Mapping[str, Option] | None:
    """The settings a `[checks.NAME]` table may give; None for a name that is neither a check nor a tool table."""
    if name in OTHER_TABLES:
        return importlib.import_module(OTHER_TABLES[name]).OPTIONS
    found = spec(name)
    return None if found is None else found.options


def validate_tables(tables: Mapping[str, Mapping[str, Any]], where: str) -> None:
    """`[checks.NAME]` tables against each check's declared options: unknown names, keys or types are one-line
    usage errors (exit 2), never settings silently ignored."""
    for name, table in tables.items():
        declared = schema(name)
        if declared is None:
            known = ", ".join([*available(), *OTHER_TABLES])
            raise PosdiagError(f"{where}: [checks.{name}]: unknown check (known: {known})")
        if not isinstance(table, Mapping):
            raise PosdiagError(f"{where}: [checks.{name}] must be a table of settings")
        for key, value in table.items():
            option = declared.get(key)
            if option is None:
                known = ", ".join(sorted(declared)) or "none"
                raise PosdiagError(f"{where}: [checks.{name}]: unknown setting '{key}' (known: {known})")
            if not option.accepts(value):
                raise PosdiagError(f"{where}: [checks.{name}] {key} = {value!r}: expected {option.type_name}")
