"""posdiag: find position-injection bugs in transformer checkpoints."""

__version__ = "0.1.0"
