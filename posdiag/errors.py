"""Errors that end a run with exit code 2 and one line: what went wrong and what to do."""


class PosdiagError(Exception):
    """A usage or load problem. The message is shown as-is, on one line, with exit code 2."""
