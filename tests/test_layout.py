"""The layout a newcomer reads at a glance, enforced: no import cycles (lazy imports included), imports that run
one way (cli -> api -> checks -> model -> results), no check importing another check, no private name imported
from another module, no module over 400 lines, no function over 60."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "posdiag"
MAX_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """Each module parsed once a run: five tests walk every module's imports (1225 parses of 175 files before)."""
    return ast.parse(path.read_text())


@functools.cache
def imports(name: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(imported module, names taken from it) for every import statement, at any depth (lazy imports count)."""
    tree = parsed(MODULES[name])
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names if alias.name.startswith("posdiag")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if not base.startswith("posdiag"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, ()) if sub in MODULES else (base, (alias.name,)))
    return tuple(found)


def graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in imports(name) if target in MODULES and target != name} for name in MODULES}


def test_no_import_cycles():
    edges, cycles = graph(), []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


# Lower layers never import higher ones. posdiag (the package __init__) only re-exports lazily. Ports (a candidate
# of `posdiag compare` and its comparison) sit beside the checks: both judge a loaded model, neither imports the
# other (test_ports_and_checks_stay_apart), and both build on posdiag.model.
LAYERS = [("posdiag.cli",), ("posdiag.testing", "posdiag.zoo"),
          ("posdiag.api", "posdiag.baseline", "posdiag.half_precision"),
          ("posdiag.checks", "posdiag.ports", "posdiag.tools", "posdiag.report"), ("posdiag.model",),
          ("posdiag.options", "posdiag.verdict", "posdiag.config", "posdiag.results", "posdiag.errors",
           "posdiag._version")]


def layer_of(name: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_imports_run_one_way():
    upward = []
    for name, targets in graph().items():
        here = layer_of(name)
        for target in targets:
            there = layer_of(target)
            if here is not None and there is not None and there < here:
                upward.append(f"{name} imports {target}")
    assert not upward, "\n".join(upward)


def check_of(name: str) -> str | None:
    """The check a module belongs to: posdiag.checks.<check>[.part] (None for checks' registry and _helpers)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["posdiag", "checks"] or parts[2].startswith("_"):
        return None
    return parts[2]


def test_ports_and_checks_stay_apart():
    """Siblings of one layer: a check judges one model, a port judges a candidate against a reference; the
    command line joins them, never one the other."""
    def area(name: str) -> str | None:
        return next((p for p in ("posdiag.checks", "posdiag.ports") if name == p or name.startswith(p + ".")), None)

    crossing = [f"{name} imports {target}" for name, targets in graph().items() for target in targets
                if area(name) and area(target) and area(name) != area(target)]
    assert not crossing, "\n".join(crossing)


def test_tools_hold_no_port():
    """posdiag/tools/ is maths (rope_math, mrope, attention, synthetic, copy_probe); a candidate's engine or its
    comparison is posdiag/ports/."""
    ported = [name for name in MODULES if name.startswith("posdiag.tools.")
              and any(word in name for word in ("served", "engine", "gguf", "onnx", "port", "quant", "compare"))]
    assert not ported, ported


def test_no_check_imports_another_check():
    crossing = [f"{name} imports {target}" for name, targets in graph().items() for target in targets
                if check_of(name) and check_of(target) and check_of(name) != check_of(target)]
    assert not crossing, "\n".join(crossing)


def test_no_private_name_imported_from_another_module():
    private = [f"{name} takes {n} from {target}" for name in MODULES for target, names in imports(name)
               for n in names if n.startswith("_") and not n.startswith("__") and target != name]
    private += [f"{name} imports private module {target}" for name in MODULES for target, _ in imports(name)
                if target.rpartition(".")[2].startswith("_") and not target.rpartition(".")[2].startswith("__")
                and target.rpartition(".")[0] != name.rpartition(".")[0]
                and not name.startswith(target.rpartition(".")[0])]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_LINES}): split it along its sections"


def test_function_size():
    """No function over MAX_FUNCTION_LINES: where the logic lives, a function reads as its phases on one screen.
    A module stays under MAX_LINES because it is one concept; a long function is split into named steps."""
    long = []
    for path in sorted(MODULES.values()):
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} has {size} lines (at most {MAX_FUNCTION_LINES})")
    assert not long, "\n".join(long)


def test_the_layout_test_sees_the_package():
    """Guard against a test that cannot fail: the walker finds the modules and their imports."""
    assert {"posdiag.api", "posdiag.cli", "posdiag.model.subject", "posdiag.checks.shuffle"} <= set(MODULES)
    assert "posdiag.model.subject" in graph()["posdiag.checks.shuffle"]
    assert {"posdiag.ports.protocol", "posdiag.ports.comparison", "posdiag.ports.candidates"} <= set(MODULES)
    assert layer_of("posdiag.ports.logits") == layer_of("posdiag.checks.shuffle")
