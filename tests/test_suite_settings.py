"""How the suite itself runs: plain pytest (no xdist) takes the project's settings, and xdist's -n schedules the
real-model modules as groups. pyproject's addopts once named `--dist loadgroup`, which pytest without xdist refuses
(exit 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONE_TEST = "tests/test_layout.py::test_imports_run_one_way"


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker's
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():  # the suite's torch settings, overridden: nothing here imports torch
    yield


@pytest.fixture(autouse=True)
def _threads_kept():
    yield


@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_a_group_runs_on_one_worker(tmp_path):
    """pytest-xdist 3.8 names a test's group on item._nodeid, which pytest 9 no longer reads: without the suite's own
    naming (tests/conftest.py) the six tests below went to both workers, and each worker built a real-model module's
    session fixtures again (SmolLM2's broken copies twice, ~150 s of one core). The suite's conftest is loaded as a
    plugin here, so --dist is named (test_xdist_schedules_by_group shows the suite choosing loadgroup itself). The file
    overrides the conftest's torch fixtures: its workers never import torch (2.4 s a run instead of 6)."""
    pytest.importorskip("xdist")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    where = tmp_path / "where.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-n", "2",
                           "--dist", "loadgroup", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_grouped.py")],
                          cwd=tmp_path,
                          env={**env, "WHERE": str(where), "PYTHONPATH": str(ROOT / "tests"),
                               "POSDIAG_ALLOW_MISSING_EVIDENCE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = where.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers


def test_plain_pytest_takes_the_project_settings():
    done = pytest_run("-p", "no:xdist", "--collect-only", "-q", ONE_TEST)
    assert done.returncode == 0, done.stdout + done.stderr


def test_xdist_schedules_by_group():
    """The schedule is chosen before any test runs, so the test named is deselected: no test runs (exit 5), and the
    worker never imports torch for it (2.4 s a run instead of 5.5)."""
    pytest.importorskip("xdist")
    unrun = ("-k", "not " + ONE_TEST.rpartition("::")[2])
    done = pytest_run("-n", "1", "-v", ONE_TEST, *unrun)
    assert done.returncode == 5 and "no tests ran" in done.stdout, done.stdout + done.stderr
    assert "LoadGroupScheduling" in done.stdout, done.stdout
    explicit = pytest_run("-n", "1", "-v", "--dist", "load", ONE_TEST, *unrun)  # a --dist given is the caller's
    assert "LoadScheduling" in explicit.stdout and "LoadGroup" not in explicit.stdout, explicit.stdout
