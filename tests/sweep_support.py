"""Helpers shared by the sweep regression tests: the sweep's tiny model of a type, and the checks run on it."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

# The sweep's configs keep Mamba-2's state sizes (128 heads, 256 states, chunks of 256: Bamba, GraniteMoeHybrid), whose
# PyTorch chunk scan takes ~10 s a check on one CPU thread; 8 heads of 16 dims, 16 states and chunks of 16 run every
# path the same way in ~0.1 s. For tests whose finding is not about the state's size.
SMALL_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 16}
SHORT = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 3}, "generate": {"new_tokens": 3}})


def sweep_model(model_type: str, **overrides):
    """The sweep's tiny model of `model_type` (transformers' default init)."""
    warnings.filterwarnings("ignore")
    return small_model(model_type, **overrides)


def run_named(model, names: list[str], options: RunOptions = SHORT) -> dict:
    """{check name: result} of `names` run on `model`."""
    return {c.name: c for c in run_checks(from_module(model), names, options).checks}


def sweep_module():
    """benchmarks/sweep.py as a module (registered under its name: its dataclasses look their module up)."""
    if "sweep" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep", Path(__file__).resolve().parent.parent / "benchmarks"
                                                      / "sweep.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["sweep"] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep"]


WRONG = "wrong values"  # benchmarks/sweep.py's Finding.kind of a path that runs and gives wrong outputs


def holds(model_type: str, check: str) -> bool:
    """Whether the upstream finding listed for (model_type, check) holds on the installed versions (transformers,
    or the finding's engine)."""
    return sweep_module().finding(model_type, check) is not None


def pinned(result, model_type: str, check: str, status: Status = Status.FAIL) -> bool:
    """`result` (a CheckResult of `check`) as the findings table predicts it on the installed versions: where the
    finding listed for (model_type, check) holds, STATUS with a summary matching its fingerprint; where none holds
    (upstream fixed it, or it is not installed), a PASS. True where it holds, for the test's own assertions on the
    failing path; every test that expects an upstream FAIL goes through here, so an upstream fix flips it."""
    found = sweep_module().finding(model_type, check)
    if found is None:
        assert result.status is Status.PASS, f"no finding holds for {model_type} {check}: {result.summary}"
        return False
    assert result.status is status and found.matches(result.summary), \
        f"{model_type} {check} ({found.what}): {result.status.value} {result.summary}"
    return True
