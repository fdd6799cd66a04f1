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
