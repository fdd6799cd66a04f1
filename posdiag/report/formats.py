"""The output formats of a check report, in one registry.

A format is a small class: its `name`, the file `suffix` it is saved under, and `format(report) -> str`.
A format with `stream = True` is a `--format NAME` choice written to stdout beside the console view; one
with `stream = False` is written to the files named by the settings in `paths` (`--json PATH`, ...).
`cli/_flow.emit` loops over `FORMATS`, and the names `--format` accepts (its help, its validation) are read
from here: adding a format is one class and one entry in `FORMATS`. The renderers are imported when a
report is formatted, so that `posdiag --help` (which reads this module) stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from rich.console import Console

    from posdiag.results import Report


class ReportFormat:
    """One output format. `describe` is the phrase `--format`'s help gives a stream format."""

    name: ClassVar[str]
    suffix: ClassVar[str]
    stream: ClassVar[bool] = False  # a --format choice, written to stdout; else written to files
    paths: ClassVar[tuple[str, ...]] = ()  # the settings holding the files it is written to
    describe: ClassVar[str] = ""

    def format(self, report: Report) -> str:
        raise NotImplementedError

    def default_here(self) -> bool:
        """A stream format chosen when --format is not given, in the environment it belongs to."""
        return False


class ConsoleFormat(ReportFormat):
    """The human view: header, a line per check, the tables behind each verdict, the verdict panel. The
    command line always shows it (`show`, on a live console); `format` is the same text without styles."""

    name, suffix, stream = "console", ".txt", True

    def show(self, report: Report, console: Console, *, quiet: bool = False) -> None:
        from posdiag.report.console import render

        render(report, console, quiet=quiet)

    def format(self, report: Report) -> str:
        """As piped (report.fit.sink_console): no line wrapped, none padded."""
        import io

        from rich.console import Console

        from posdiag.report.fit import UNWRAPPED, TrimmedLines

        buffer = io.StringIO()
        self.show(report, Console(file=TrimmedLines(buffer), width=UNWRAPPED, color_system=None, force_terminal=False))
        return buffer.getvalue()


class GithubFormat(ReportFormat):
    """GitHub Actions workflow commands (::error, ::warning, ::notice), the default inside GitHub Actions."""

    name, suffix, stream = "github", ".txt", True
    describe = "::error annotations; default in GitHub Actions"

    def format(self, report: Report) -> str:
        from posdiag.report.github import format_github

        return format_github(report)

    def default_here(self) -> bool:
        import os

        return os.environ.get("GITHUB_ACTIONS") == "true"


class JsonFormat(ReportFormat):
    """The stable, versioned JSON report; a saved baseline is the same document."""

    name, suffix, paths = "json", ".json", ("json", "save_baseline")

    def format(self, report: Report) -> str:
        from posdiag.report.json_report import format_json

        return format_json(report)


class JunitFormat(ReportFormat):
    """JUnit XML, one testcase per check, for CI systems that show test reports."""

    name, suffix, paths = "junit", ".xml", ("junit",)

    def format(self, report: Report) -> str:
        from posdiag.report.junit import format_junit

        return format_junit(report)


class HtmlFormat(ReportFormat):
    """One self-contained HTML page (inline CSS and SVG, nothing fetched): the terminal's view, then a section per
    check with its error plotted against position, its tables and what each path it ran confirmed."""

    name, suffix, paths = "html", ".html", ("html",)

    def format(self, report: Report) -> str:
        from posdiag.report.html import format_html

        return format_html(report)


CONSOLE = ConsoleFormat()
FORMATS: dict[str, ReportFormat] = {f.name: f for f in (CONSOLE, GithubFormat(), JsonFormat(), JunitFormat(),
                                                        HtmlFormat())}


def stream_names() -> tuple[str, ...]:
    """The names `--format` accepts, in registry order."""
    return tuple(name for name, fmt in FORMATS.items() if fmt.stream)


def default_stream() -> str:
    """The stream format a run without --format writes: the first that belongs here, else the console."""
    return next((f.name for f in FORMATS.values() if f.stream and f.default_here()), CONSOLE.name)


def format_help() -> str:
    """`--format`'s help, from the stream formats: "console or github (::error annotations; ...)."""
    parts = [f"{f.name} ({f.describe})" if f.describe else f.name for f in FORMATS.values() if f.stream]
    return " or ".join(parts) + "."
