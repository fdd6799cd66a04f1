"""The version, in a module of its own so that results and the CLI can read it without importing the package API."""

__version__ = "0.1.0"

# The transformers releases the compatibility run (benchmarks/compat.py, docs/support.md) judged: an internal a
# family hook reads that is missing outside them is named with this range (errors.InternalsChanged).
TRANSFORMERS_TESTED = ("5.17.0", "5.25.0")
