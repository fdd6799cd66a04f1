"""Option groups: a set of command-line options declared once (cli/options.py: load, run, output, gate,
config) and taken by every command that needs it. Typer reads a command's options from its signature and
has no groups, so `takes(load=LOAD, ...)` writes each group's options into the command's signature and
hands the command one `Given` per group instead: `load.dtype`, or `Settings(**load, **run)`.

A command takes a part of a group (`RUN.only("seed")`) or declares one of its options its own way
(`LOAD.but(upcast=Opt(KernelsUpcast, False))`): the name, and so the `Settings` field, stays the same.
Nothing heavy is imported here: `posdiag --help` reads it."""

from __future__ import annotations

import enum
import functools
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Opt:
    """One option: its Typer annotation (`Annotated[type, typer.Option(...)]`) and its default."""

    annotation: Any
    default: Any = None


@dataclass(frozen=True)
class Group:
    """Options a command takes together, by the name of the parameter (and `Settings` field) each fills."""

    name: str
    options: Mapping[str, Opt]

    def only(self, *names: str) -> Group:
        return Group(self.name, {name: self.options[name] for name in names})

    def without(self, *names: str) -> Group:
        self._known(names)
        return Group(self.name, {k: v for k, v in self.options.items() if k not in names})

    def but(self, **changed: Opt) -> Group:
        """The same options, some declared another way (another help, another default)."""
        self._known(changed)
        return Group(self.name, {**self.options, **changed})

    def _known(self, names: typing.Iterable[str]) -> None:
        missing = set(names) - set(self.options)
        if missing:
            raise KeyError(f"group {self.name} has no option {', '.join(sorted(missing))}")

    def parameters(self) -> list[inspect.Parameter]:
        return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=opt.annotation,
                                  default=opt.default) for name, opt in self.options.items()]

    def take(self, kwargs: dict[str, Any]) -> Given:
        """This group's values out of the command's keyword arguments (an enum choice as its value)."""
        values = {name: kwargs.pop(name) for name in self.options}
        return Given({k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()})


class Given(Mapping[str, Any]):
    """One group's values as the command line (or its defaults) gave them: read as attributes, or spread
    into `Settings(**given)`."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never an option (and copy/pickle probe these before __init__)
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Given({self._values!r})"


def takes(**groups: Group) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Put each group's options into the command's signature (after its own parameters, where the group's
    parameter stood) and call the command with one `Given` per group, under the parameter's name."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(command, include_extras=True)
        params: list[inspect.Parameter] = []
        for param in inspect.signature(command).parameters.values():
            if param.name in groups:
                params += groups[param.name].parameters()
            else:
                params.append(param.replace(annotation=hints.get(param.name, param.annotation)))
        names = [p.name for p in params]
        if len(names) != len(set(names)):
            raise TypeError(f"{command.__name__}: an option is declared twice")

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            for key, group in groups.items():
                kwargs[key] = group.take(kwargs)
            return command(*args, **kwargs)

        run.__signature__ = inspect.Signature(_ordered(params))  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


def _ordered(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """Keyword-only options after the positional parameters, as a signature requires (help order follows)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in params if p.kind in kinds] + [p for p in params if p.kind not in kinds]
