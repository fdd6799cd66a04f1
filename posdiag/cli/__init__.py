"""The Typer app: parse, call the API, render, exit. No check logic lives here.

One module per command (check.py holds shuffle and check); options.py holds what they accept (the option
groups every command takes through groups.takes) and the `Settings` they build, _io.py how they end,
_flow.py the steps the model commands share (emit writes the formats of report/formats.py). Command
modules never import this package's `__init__`; it imports them to register the commands.
Heavy imports (torch, transformers) happen inside commands so `posdiag --help` is instant.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from posdiag._version import __version__
from posdiag.cli import check, compare, kernels, rope
from posdiag.cli._io import interrupted


def _threads_before_torch(env: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """How OpenMP threads wait, set before torch loads (its OpenMP runtime reads the environment once).

    posdiag runs many small forwards (one-token cache steps, per-row probes); beside another busy process OpenMP's
    idle threads spinning for work cost more than the work: measured on 2 cores, `check --only shuffle,cache` on the
    real SmolLM2 took 144 s as is and 24 s with one thread (benchmarks/threads.py). Passive waiting keeps every core
    for a quiet machine and stops spinning on a busy one. POSDIAG_THREADS=N runs N threads (OMP_NUM_THREADS, unless
    that is set); POSDIAG_THREADS=omp leaves OpenMP's own defaults; an OMP_WAIT_POLICY you set is kept."""
    chosen = env.get("POSDIAG_THREADS", "").strip().lower()
    if chosen == "omp":
        return
    if chosen.isdigit() and int(chosen) > 0:
        env.setdefault("OMP_NUM_THREADS", chosen)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_threads_before_torch()

def exit_codes(gate: tuple[str, ...] = ("--fail-on", "--require"), found: str = "a position bug found (a check "
               "failed)", internal: str = "posdiag could not run a check (an internal error, not a finding about the "
               "model: please report it)") -> str:
    """The exit-code paragraph of a help page, naming only the gate options the command has."""
    allowed = "warnings and skips allowed" + (" unless --fail-on refuses them" if "--fail-on" in gate else "")
    refused = f", or the gate policy refused a result ({', '.join(gate)})" if gate else ""
    return (f"Exit codes: 0 no check failed ({allowed}); 1 {found}{refused}; 2 usage or load error; 3 {internal}, "
            "and nothing else failed the gate; 130 interrupted (Ctrl-C).")


EXIT_CODES = exit_codes()

app = typer.Typer(
    name="posdiag",
    help="Find position-injection bugs in transformer checkpoints.",
    epilog=EXIT_CODES,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help: wraps between words at any width, never cuts an option name
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"posdiag {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool,
                       typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
) -> None:
    """posdiag permutes, shifts and probes a model's inputs to tell whether position really entered it."""


def _interruptible(command: Callable[..., Any]) -> Callable[..., Any]:
    """Ctrl-C anywhere in a command (loading, checks, rendering) ends it with exit 130 and one line."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            interrupted()

    return run


class _Command(TyperCommand):
    """Arguments on the usage line as click writes them, for every command alike: a required one bare (MODEL,
    REFERENCE), an optional one in brackets ([MODEL], [CANDIDATE]); typer writes a required one in braces."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":  # typer may ship its own click: its classes are not click's
                name = (param.metavar or param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces


def _epilog(command: Callable[..., Any]) -> str:
    """Each command's exit codes, with the gate options it takes and what its 1 and 3 mean."""
    params = inspect.signature(command).parameters
    gate = tuple(f"--{name.replace('_', '-')}" for name in ("fail_on", "require") if name in params)
    if command is compare.compare:
        return exit_codes(gate, "the candidate differs from its reference (the comparison failed)",
                          "posdiag could not run the comparison (an internal error: please report it), or the engine "
                          "running the candidate crashed")
    return exit_codes(gate)


for command in (check.shuffle, check.check, compare.compare, kernels.kernels, rope.rope):
    app.command(cls=_Command, short_help=(command.__doc__ or "").strip().splitlines()[0],
                epilog=_epilog(command))(_interruptible(command))
del command

__all__ = ["app", "main"]
