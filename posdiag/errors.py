"""Errors that end a run with exit code 2 and one line: what went wrong and what to do."""


class PosdiagError(Exception):
    """A usage or load problem. The message is shown as-is, on one line, with exit code 2."""


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), at most 300 characters."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def describe_error(exc: BaseException) -> str:
    """`Type: first line`, at most 200 characters: an exception named in a verdict or a skip reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
