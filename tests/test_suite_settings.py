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


def test_plain_pytest_takes_the_project_settings():
    done = pytest_run("-p", "no:xdist", "--collect-only", "-q", ONE_TEST)
    assert done.returncode == 0, done.stdout + done.stderr


def test_xdist_schedules_by_group():
    pytest.importorskip("xdist")
    done = pytest_run("-n", "1", "-v", ONE_TEST)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LoadGroupScheduling" in done.stdout, done.stdout
    explicit = pytest_run("-n", "1", "-v", "--dist", "load", ONE_TEST)  # a --dist given is the caller's
    assert "LoadScheduling" in explicit.stdout and "LoadGroup" not in explicit.stdout, explicit.stdout
