"""How the command line ends and where its text goes: a PosdiagError (or any crash) is one line on
stderr and exit 2 (with --debug the traceback first, same exit code), an interrupt is
"posdiag: interrupted" and exit 130, and `-` as a path means stdout."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


def fail(message: str, code: int = 2) -> NoReturn:
    """A usage or load error: one line on stderr, exit 2 (3 for an engine that crashed)."""
    typer.echo(f"posdiag: error: {message}", err=True)
    raise typer.Exit(code)


def interrupted() -> NoReturn:
    """Ctrl-C, wherever it lands: one line on stderr, exit 130."""
    from posdiag.results import INTERRUPTED

    typer.echo("posdiag: interrupted", err=True)
    raise typer.Exit(INTERRUPTED)


def guarded(fn: Callable[[], T], debug: bool) -> T:
    """Run fn; a PosdiagError (or any load-time crash) becomes one line on stderr and exit 2.
    --debug prints the traceback before that line; the exit code stays the same."""
    import traceback

    from posdiag.errors import PosdiagError

    try:
        return fn()
    except PosdiagError as exc:
        if debug:
            traceback.print_exc()
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        interrupted()
    except Exception as exc:
        if debug:
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"{type(exc).__name__}: {first[:300]}" + ("" if debug else " (rerun with --debug for the traceback)"))


# The torch profiler's C++ logger (kineto) writes `USDT:2026-... profiler_start` lines straight to fd 2.
KINETO_LINE = re.compile(r"^(USDT|INFO|WARNING|STAGE):\d{4}-\d\d-\d\d .*\] ")


@contextlib.contextmanager
def without_profiler_noise() -> Iterator[None]:
    """Hold back what native code writes to stderr (fd 2) in the block and pass on all but the
    profiler's log lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not KINETO_LINE.match(line)]
            sys.stderr.write("".join(kept))


@contextlib.contextmanager
def loading(spec: str) -> Iterator[None]:
    """While MODEL loads (seconds to minutes): a spinner on a terminal; anywhere else (a CI log, a pipe) one line
    on stderr, `posdiag: loading MODEL ...`, so the wait is not silence, and stdout stays the report's alone."""
    from rich.console import Console

    err = Console(stderr=True)
    if err.is_terminal:
        with err.status(f"loading {spec}…"):
            yield
        return
    print(f"posdiag: loading {spec} ...", file=sys.stderr, flush=True)
    yield


def write_output(path: str, text: str, debug: bool) -> None:
    """Write text to stdout when path is `-`, else to the file (a file that cannot be written is exit 2)."""
    if path == "-":
        sys.stdout.write(text)
    else:
        guarded(lambda: Path(path).write_text(text), debug)


def console_for(*paths: str | None) -> Console:
    """The console for the human-readable output: stderr when a report file (--json, --junit...) goes to stdout.
    Outside a terminal no line is wrapped and none ends in spaces (report.fit.sink_console)."""
    from posdiag.report.fit import sink_console

    return sink_console(stderr="-" in paths)
