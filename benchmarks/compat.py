"""The transformers versions posdiag is tested on: every check on each zoo family, and the findings' tests, per version.

    python benchmarks/compat.py                          # the default versions, table printed
    python benchmarks/compat.py --write                  # also benchmarks/compat.json and docs/support.md's table
    python benchmarks/compat.py --versions 5.17.0,5.25.0 --venvs /tmp/posdiag-compat

Each version gets a throwaway virtual environment of its own (under --venvs; made once, reused): torch at the
version constraints.txt pins, transformers at that version with whatever it resolves (its hub and tokenizers), and
posdiag's other dependencies; posdiag itself runs from this checkout (PYTHONPATH), nothing installed into it. In
that environment it runs `benchmarks/support_matrix.py` (every check on each family of posdiag.testing.zoo, healthy,
and the headline check with positions removed) and the tests that pin upstream findings and version-keyed
behaviour (FINDINGS' tests in benchmarks/sweep.py and the ones below). A finding's test expects the FAIL where the
finding's `since`/`fixed_in` say it holds on that version, and the PASS elsewhere: a failing test here is a table
entry that is wrong for that version. Not part of the per-commit suite (minutes per version); the suite runs on the
pinned version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "compat.json"
PAGE = ROOT / "docs" / "support.md"
VERSIONS = ("5.17.0", "5.24.0", "5.25.0")
# what posdiag needs besides torch and transformers (their versions resolved for each transformers)
NEEDS = ("typer", "rich", "accelerate", "safetensors", "gguf", "pytest", "pytest-xdist", "hypothesis")
# tests of version-keyed behaviour beyond FINDINGS' own tests (module-level names, run whole)
VERSION_KEYED = (
    "tests/test_kernels.py::test_falcon_alibi_eager_adds_alibi_twice",
    "tests/test_kernels.py::test_every_family_passes_or_says_why",
    "tests/test_every_check.py::test_no_check_errors_at_default_settings",
    "tests/test_multimodal.py::test_llama4_is_driven_through_its_language_model",
    "tests/test_sweep_findings_a.py::test_pure_mamba_granitemoehybrid_cannot_use_a_cache",
    "tests/test_sweep_recurrent.py::test_recurrent_gemma_findings_left_padding_without_ids_and_chunked_continuation",
    "tests/test_sweep_inkling.py",
    "tests/test_shift.py::test_falcon_alibi_bias_is_computed_in_bfloat16",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(VERSIONS))
    parser.add_argument("--venvs", default="/tmp/posdiag-compat", help="where the throwaway environments live")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--part", choices=("both", "families", "tests"), default="both",
                        help="run one part again, keeping the other's recorded results")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for version in [v for v in args.versions.split(",") if v]:
        start = time.time()
        python = environment(Path(args.venvs) / version, version)
        done = results.get(version, {})
        results[version] = {"families": families(python) if args.part != "tests" else done.get("families", {}),
                            "tests": tests(python) if args.part != "families" else done.get("tests", {}),
                            "seconds": round(time.time() - start)}
        print(f"transformers {version}: {results[version]['seconds']} s", flush=True)
        if args.write:  # each version as it finishes: an interrupted run keeps what it measured
            write(results)
    print(table(results))


def write(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = PAGE.read_text()
    PAGE.write_text(re.sub(r"<!-- compat:start -->.*?<!-- compat:end -->",
                           f"<!-- compat:start -->\n{table(results)}\n<!-- compat:end -->", text, flags=re.S))


def environment(where: Path, version: str) -> Path:
    """The environment's python, made once: torch as constraints.txt pins it, transformers at `version`."""
    python = where / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        torch = next(line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, torch], check=True)
        subprocess.run([*pip, f"transformers=={version}", *NEEDS], check=True)
    return python


def _run(python: Path, *command: str, timeout: float = 3600) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(python), *command], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    return proc.stdout + proc.stderr


def families(python: Path) -> dict[str, dict[str, str]]:
    """family -> {check: status} from support_matrix.py's rows (the last column: shuffle with positions removed)."""
    out = _run(python, str(HERE / "support_matrix.py"))
    header = next((line for line in out.splitlines() if line.startswith("| family |")), None)
    rows: dict[str, dict[str, str]] = {}
    if header is None:
        return {"(run)": {"error": out.strip().splitlines()[-1][:200] if out.strip() else "no output"}}
    names = [c.strip() for c in header.strip("|").split("|")][3:]
    for line in out.splitlines():
        cells = [c.strip().strip("*").lower() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == len(names) + 3 and cells[0] not in ("family", "---"):
            rows[cells[0]] = dict(zip(names, cells[3:], strict=True))
    return rows


def tests(python: Path) -> dict[str, str]:
    """test id -> passed/failed/skipped for the findings' tests and the version-keyed ones."""
    sys.path.insert(0, str(HERE))
    import sweep  # benchmarks/sweep.py: FINDINGS names the test that reproduces each finding

    chosen = sorted({f.test.split("::")[0] + "::" + f.test.split("::")[1] for _, _, f in sweep.every_finding()}
                    | set(VERSION_KEYED))
    out = _run(python, "-m", "pytest", "-n", "2", "-q", "-rA", "-p", "no:cacheprovider", *chosen)
    found = {}
    for line in out.splitlines():
        match = re.match(r"(PASSED|FAILED|SKIPPED|ERROR) (\S+)", line)
        if match:
            found[match.group(2)] = match.group(1).lower()
    return found or {"(run)": out.strip().splitlines()[-1][:200] if out.strip() else "no output"}


def table(results: dict) -> str:
    """docs/support.md's compatibility section: one row per family, a column per version (the checks that did not
    PASS, by status), then the tests that pin version-keyed behaviour and findings that failed per version."""
    versions = sorted(results, key=lambda v: tuple(int(p) for p in v.split(".")))
    lines = [f"| family | {' | '.join(versions)} |", "|---" * (len(versions) + 1) + "|"]
    every = sorted({f for v in versions for f in results[v]["families"]})
    for family in every:
        cells = [_cell(results[v]["families"].get(family)) for v in versions]
        lines.append(f"| {family} | {' | '.join(cells)} |")
    lines += ["", "| version | tests of findings and version-keyed behaviour | not passed |", "|---|---|---|"]
    for v in versions:
        got = results[v]["tests"]
        bad = sorted(t for t, s in got.items() if s not in ("passed", "skipped"))
        lines.append(f"| {v} | {sum(s == 'passed' for s in got.values())} passed, "
                     f"{sum(s == 'skipped' for s in got.values())} skipped | "
                     f"{', '.join(f'`{t}` ({got[t]})' for t in bad) or 'none'} |")
    return "\n".join(lines)


def _cell(row: dict[str, str] | None) -> str:
    """What did not PASS (n/a and skip are by design or with a reason; FAIL and ERROR are named first)."""
    if not row:
        return "not run"
    row = dict(row)
    removed = row.pop("shuffle, positions removed", "")
    order = ("error", "fail", "warn", "skip")
    shown = [f"{s.upper()} {', '.join(n for n, st in row.items() if st == s)}" for s in order
             if any(st == s for st in row.values())]
    if removed != "fail":
        shown.append(f"planted twin {removed.upper() or 'not run'}")
    return "; ".join(shown) or "all PASS or n/a"


if __name__ == "__main__":
    main()
