"""The findings table (benchmarks/sweep.py FINDINGS) is what the suite's expectations of upstream bugs come from.

Every test that expects a stock model (transformers, or llama.cpp through llama-cpp-python) to FAIL asks the table
whether the finding holds on the installed version (sweep_support.pinned / holds, test_findings_plain's helpers):
where it holds, the FAIL with the finding's fingerprint; where upstream fixed it, a PASS. Shown here both ways, on
results and on a reproduction, with the table changed under the test; and every row of the table is exercised by
some test that consults it, or is listed as shown by the sweep alone.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import test_findings_plain as plain
from sweep_support import holds, pinned, sweep_module

from posdiag.results import CheckResult, Status

TESTS = Path(__file__).resolve().parent


def fixed(monkeypatch, key: str, check: str, engine: str = "transformers") -> None:
    """The table as it will read once upstream fixes (key, check): its entry fixed in the installed release."""
    table = sweep_module().FINDINGS[key]
    entry = table[check]
    entries = entry if isinstance(entry, tuple) else (entry,)
    moved = tuple(dataclasses.replace(f, fixed_in=version(engine)) for f in entries)
    monkeypatch.setitem(table, check, moved if isinstance(entry, tuple) else moved[0])


MAMBA_CHUNKS = "dynamic/chunks: step 1 (positions 4-6) differs from the full forward by 0.00362 (a bug in float64)"


def test_a_pinned_fail_becomes_a_pass_once_the_table_says_upstream_fixed_it(monkeypatch):
    failing = CheckResult("cache", Status.FAIL, MAMBA_CHUNKS)
    passing = CheckResult("cache", Status.PASS, "every path agrees with the full forward")
    assert pinned(failing, "mamba", "cache") is True
    with pytest.raises(AssertionError, match="mamba cache"):
        pinned(passing, "mamba", "cache")  # the finding holds: a PASS is a miss
    with pytest.raises(AssertionError):
        pinned(CheckResult("cache", Status.FAIL, "dynamic/decode: step 1 differs by 0.01"), "mamba", "cache")
    fixed(monkeypatch, "mamba", "cache")
    assert not holds("mamba", "cache")
    assert pinned(passing, "mamba", "cache") is False
    with pytest.raises(AssertionError, match="no finding holds for mamba cache"):
        pinned(failing, "mamba", "cache")  # fixed upstream: the old FAIL is now a false verdict


def test_a_plain_reproduction_expects_agreement_once_upstream_fixed_it(monkeypatch):
    """The same reproduction, the same model: it passes as the table stands (the bug shows), and fails once the
    table says the bug is fixed (it expects the two computations to agree, and they still differ)."""
    plain.test_cached_continuation_differs_from_the_full_forward("zoo:gpt_neo")
    fixed(monkeypatch, "zoo:gpt_neo", "cache")
    with pytest.raises(AssertionError, match="the bug differs"):
        plain.test_cached_continuation_differs_from_the_full_forward("zoo:gpt_neo")


def test_llama_cpp_findings_are_keyed_by_llama_cpp_python_s_version(monkeypatch):
    sweep = sweep_module()
    found = sweep.FINDINGS["llama.cpp:qwen2"]["compare"]
    assert found.engine == "llama-cpp-python" and found.versions().startswith("llama-cpp-python: ")
    assert found.holds("0.3.36") and dataclasses.replace(found, fixed_in="0.3.37").holds("0.3.36")
    assert not dataclasses.replace(found, fixed_in="0.3.36").holds("0.3.36")
    assert not dataclasses.replace(found, engine="no-such-distribution").holds()  # not installed: cannot hold
    transformers_row = sweep.FINDINGS["mamba"]["cache"]  # a transformers row ignores llama-cpp-python's version
    assert transformers_row.holds() and transformers_row.engine == "transformers"
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    assert holds("llama.cpp:qwen2", "compare")
    fixed(monkeypatch, "llama.cpp:qwen2", "compare", engine="llama-cpp-python")
    assert not holds("llama.cpp:qwen2", "compare")


# ------------------------------------------------------------------ every row exercised
CONSULTS = {"pinned": (1, 2), "holds": (0, 1), "finding": (0, 1), "assert_as_found": (0, 1),
            "_raises_as_found": (0, 1)}
"""The calls that consult the table, and where their (key, check) arguments are."""

SWEEP_ONLY = {("inkling2", "generate"), ("inkling2_loop", "generate"), ("inkling_mm_model", "cache"),
              ("inkling_mm_model", "generate"), ("moshi", "generate")}
"""Rows no test exercises through the table: shown by the sweep's committed rows alone (test_support_subset checks
each is what its row shows). Their siblings are exercised: Inkling2 and Inkling2-loop through their text models,
Inkling's multimodal model through inkling_text, Moshi's generate through its cache."""


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _module_values(tree: ast.Module) -> dict[str, list]:
    """Module-level names bound to a literal tuple/list (their items) or a dict (its keys, `**dict.fromkeys(NAME)` and
    `**{(..., v) for v in (...)}` entries included)."""
    names: dict[str, list] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = _items(node.value, names)
    return names


def _items(node: ast.AST, names: dict[str, list]) -> list:
    if isinstance(node, (ast.Tuple, ast.List)):
        return [v for v in (_literal(e) for e in node.elts) if v is not None]
    if isinstance(node, ast.Dict):
        out = []
        for key, value in zip(node.keys, node.values, strict=True):
            out += [_literal(key)] if key is not None else _items(value, names)
        return [v for v in out if v is not None]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "fromkeys":
        return names.get(getattr(node.args[0], "id", ""), [])
    if isinstance(node, ast.DictComp) and len(node.generators) == 1:
        return _comprehension_keys(node)
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("sorted", "exhaustive", "list", "tuple"):
        return _items(node.args[0], names)
    if isinstance(node, ast.Name):
        return names.get(node.id, [])
    return []


def _comprehension_keys(node: ast.DictComp) -> list:
    """Keys of `{(k, v): ... for v in (...)}` / `{(k, v): ... for v, _ in (...)}` over a literal sequence."""
    gen = node.generators[0]
    targets = [t.id for t in gen.target.elts] if isinstance(gen.target, ast.Tuple) else [gen.target.id]
    out = []
    for element in getattr(gen.iter, "elts", []):
        parts = element.elts if isinstance(element, ast.Tuple) and len(targets) > 1 else [element]
        bound = {t: _literal(p) for t, p in zip(targets, parts, strict=False)}
        key = node.key
        items = key.elts if isinstance(key, ast.Tuple) else [key]
        values = tuple(bound.get(i.id) if isinstance(i, ast.Name) else _literal(i) for i in items)
        out.append(values if isinstance(key, ast.Tuple) else values[0])
    return out


def _bindings(function: ast.FunctionDef, names: dict[str, list]) -> dict[str, list]:
    """What each name in a test function can be: its parametrize values, and literal `for` loops inside it."""
    bound: dict[str, list] = {}
    for deco in function.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize":
            given = _literal(deco.args[0]) or ""
            argnames = [a.strip() for a in (given.split(",") if isinstance(given, str) else given) if a.strip()]
            values = _items(deco.args[1], names)
            for i, name in enumerate(argnames):
                bound[name] = [v[i] if len(argnames) > 1 and isinstance(v, tuple) else v for v in values]
    for node in ast.walk(function):
        if isinstance(node, ast.For):
            targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
            for element in getattr(node.iter, "elts", []):
                parts = element.elts if isinstance(element, ast.Tuple) and len(targets) > 1 else [element]
                for target, part in zip(targets, parts, strict=False):
                    if isinstance(target, ast.Name) and _literal(part) is not None:
                        bound.setdefault(target.id, []).append(_literal(part))
    return bound


def _patterns(node: ast.AST, bound: dict[str, list]) -> list[str]:
    """Regular expressions for the values an argument can take (an f-string's placeholders match anything)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [re.escape(node.value)]
    if isinstance(node, ast.JoinedStr):
        return ["".join(re.escape(p.value) if isinstance(p, ast.Constant) else ".+" for p in node.values)]
    if isinstance(node, ast.Name):
        return [re.escape(v) for v in bound.get(node.id, []) if isinstance(v, str)]
    return []


def consulted() -> set[tuple[str, str]]:
    """(key pattern, check pattern) of every consultation of the table inside a test function of tests/."""
    found = set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = _module_values(tree)
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            bound = _bindings(function, names)
            for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                name = getattr(call.func, "id", getattr(call.func, "attr", ""))
                if name in CONSULTS and len(call.args) > max(CONSULTS[name]):
                    key, check = (call.args[i] for i in CONSULTS[name])
                    found |= {(k, c) for k in _patterns(key, bound) for c in _patterns(check, bound)}
    return found


def test_every_finding_row_is_exercised_by_a_test_or_listed_as_sweep_only():
    patterns = consulted()
    rows = {(key, check) for key, check, _ in sweep_module().every_finding()}
    exercised = {(key, check) for key, check in rows
                 if any(re.fullmatch(k, key) and re.fullmatch(c, check) for k, c in patterns)}
    assert rows - exercised == SWEEP_ONLY, sorted(rows - exercised)


def test_the_coverage_reading_sees_literal_parametrized_and_looped_consultations():
    """The reader of test sources itself: a literal call, a parametrized one, a loop, and an f-string each count;
    an argument it cannot resolve counts for nothing (so a row is never covered by accident)."""
    source = '''
ROWS = ("jamba",)
KEYS = {"mamba": 1, **dict.fromkeys(ROWS, 2)}

@pytest.mark.parametrize("model_type", sorted(KEYS))
def test_a(model_type):
    pinned(result, "zamba", "state")
    assert_as_found(model_type, "cache", 1, 0)
    for name in ("cache", "generate"):
        pinned(result, f"zoo:{family}", name)
    holds(anything, "batch")
'''
    tree = ast.parse(source)
    names = _module_values(tree)
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    bound = _bindings(function, names)
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in CONSULTS]
    got = {(k, c) for call in calls for k in _patterns(call.args[CONSULTS[call.func.id][0]], bound)
           for c in _patterns(call.args[CONSULTS[call.func.id][1]], bound)}
    assert got == {("zamba", "state"), ("mamba", "cache"), ("jamba", "cache"), ("zoo:.+", "cache"),
                   ("zoo:.+", "generate")}
