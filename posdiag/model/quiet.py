"""transformers' warnings about how posdiag calls it, held back around posdiag's own calls only.

posdiag calls generate() in ways a user rarely does (the model as its own assistant, every cache implementation):
transformers answers some of them with deprecation notices about its own internals (assisted decoding passes a
generation config and keywords together: "Passing `generation_config` together with generation-related arguments is
deprecated"). Through the Python API those land in the user's test output, about calls the user never made. The CLI
silences transformers' logging for the whole run; the API must not change a caller's logging, so the notices are held
back inside the block and everything is as it was after it. Errors still pass.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' log warnings (its library logger) and deprecation warnings, inside the block only."""
    logger = logging.getLogger("transformers")
    level = logger.level
    if logger.getEffectiveLevel() < logging.ERROR:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logger.setLevel(level)
