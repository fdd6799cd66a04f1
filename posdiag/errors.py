"""Errors that end a run with exit code 2 and one line: what went wrong and what to do."""


class PosdiagError(Exception):
    """A usage or load problem. The message is shown as-is, on one line, with exit code 2."""

    exit_code = 2


class EngineCrash(PosdiagError):
    """An engine in a child process (llama.cpp) crashed, aborted or hung: one line, exit code 3 (the engine
    failed on a file that posdiag had read and found sound, so it is not a usage error)."""

    exit_code = 3


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), at most 300 characters."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def describe_error(exc: BaseException) -> str:
    """`Type: first line`, at most 200 characters: an exception named in a verdict or a skip reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def raised_in_posdiag(exc: BaseException) -> bool:
    """Whether posdiag's own code raised `exc` rather than the model it ran.

    The innermost frame of the traceback outside torch decides: inside the posdiag package it is
    posdiag's bug (to be raised, so the run reports an error); anywhere else (transformers, the model's
    own modeling code, a user's factory) it is the model's answer to the input it was given. Frames in
    torch are skipped because a model's indexing error surfaces there (F.embedding, a tensor op)."""
    import os

    where = _raised_at(exc)
    return where is not None and where.startswith(os.path.dirname(os.path.abspath(__file__)) + os.sep)


def refused_by_generation(exc: BaseException) -> bool:
    """Whether transformers' generation code refused the request: a ValueError raised directly in
    ``transformers/generation/`` (argument and configuration validation: special tokens, cache kinds,
    generation modes). Whether the model had run yet is the caller's to tell."""
    import os

    import transformers

    where = _raised_at(exc)
    generation = os.path.join(os.path.dirname(os.path.abspath(transformers.__file__)), "generation") + os.sep
    return isinstance(exc, ValueError) and where is not None and where.startswith(generation)


def raised_in_generation(exc: BaseException) -> bool:
    """Whether the exception (of any type) was raised directly in ``transformers/generation/``: generation code
    refusing a mode for this model (MPT under assisted decoding: "Assisted decoding requires a cache"), not the
    model's own forward."""
    import os

    import transformers

    where = _raised_at(exc)
    generation = os.path.join(os.path.dirname(os.path.abspath(transformers.__file__)), "generation") + os.sep
    return where is not None and where.startswith(generation)


def _raised_at(exc: BaseException) -> str | None:
    """The file of the innermost traceback frame outside torch (None when every frame is in torch)."""
    import os
    import traceback

    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frames = [os.path.abspath(f.filename) for f in traceback.extract_tb(exc.__traceback__)]
    outside_torch = [f for f in frames if not f.startswith(torch_dir)]
    return outside_torch[-1] if outside_torch else None


class InternalsChanged(Exception):
    """A transformers internal that a family hook reads (a kwarg a block is handed, a module attribute, a function of
    a modeling module) is not there in the installed transformers. Not a finding about the model and not a crash to
    report as posdiag's bug: the check SKIPs, naming what changed and the versions posdiag was tested on, so a healthy
    model is never an ERROR because a release renamed something."""

    def __init__(self, what: str):
        import transformers

        from posdiag._version import TRANSFORMERS_TESTED, __version__

        self.what = what
        low, high = TRANSFORMERS_TESTED
        super().__init__(f"this transformers version ({transformers.__version__}) changed {what}; "
                         f"posdiag {__version__} knows transformers {low} to {high}")


class MaskRefused(Exception):
    """The model refuses the explicit attention-mask form a probe needs, and no form it accepts expresses the
    probe's pattern (a permuted or edited pattern has no 2D padding-mask form). Not a finding about the model and
    not posdiag's bug: the check, or the stack, cannot be judged, and says why (a SKIP with this message)."""
