"""Usage errors found before any work: MODEL (or a candidate) that looks like a local path or file but is not
there, a server address that does not parse, a device this machine does not have, the output format, the files a
run will write, the baseline it will read. Each is one line on stderr and exit 2, answered at once (no model load,
no hub request; torch is imported only to ask for a device other than the CPU). Nothing heavy is imported here."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from posdiag.cli._io import fail, guarded
from posdiag.cli.options import Settings
from posdiag.report.formats import stream_names

FILE_SUFFIXES = (".gguf", ".onnx", ".json")
"""What names a file, never a hub id: a GGUF file, an ONNX graph, a config.json (`rope`)."""


def model_spec(spec: str) -> None:
    """A MODEL that looks local (starts with `.`, `/` or `~`, names a path whose first component is here,
    or ends in a file suffix such as .gguf) and does not exist is a typo, not a hub id: say so instead of
    asking the hub (or loading a reference first)."""
    if os.path.exists(os.path.expanduser(spec)) or _looks_like_factory(spec):
        return
    parts = [p for p in spec.replace(os.sep, "/").split("/") if p]
    local = spec.startswith((".", "/", "~")) or (len(parts) > 1 and os.path.exists(parts[0])) or spec.count("/") > 1
    if not local and not spec.lower().endswith(FILE_SUFFIXES):
        return
    fail(f"'{spec}' does not exist (no such file or directory){_did_you_mean(spec)}")


def server_address(url: str) -> None:
    """A server candidate's base address parses (http(s)://HOST:PORT/v1, nothing else in it)."""
    from posdiag.ports.engines.http_server import address_problem

    problem = address_problem(url)
    if problem:
        fail(problem)


def load_options(settings: Settings) -> None:
    """The device is on this machine, a --max-memory budget parses, --offload-folder and --max-memory come with
    --device-map (posdiag.model.loading.check_load_options, which every load runs again)."""
    if settings.device in ("auto", "cpu") and not (settings.max_memory or settings.offload_folder):
        return  # nothing to ask torch
    from posdiag.cli.options import load_options as options_of
    from posdiag.model.loading import check_load_options

    guarded(lambda: check_load_options(options_of(settings)), settings.debug)


def _looks_like_factory(spec: str) -> bool:
    module, _, attr = spec.rpartition(":")
    return bool(module) and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))


def _did_you_mean(spec: str) -> str:
    path = Path(os.path.expanduser(spec))
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return ""
    try:
        names = [p.name for p in parent.iterdir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    if not close or parent != path.parent:
        return ""
    return f"; did you mean '{os.path.join(os.path.dirname(spec), close[0])}'?"


def output_format(settings: Settings) -> None:
    """--format names one of the registry's stream formats."""
    from posdiag.report.formats import FORMATS

    names = stream_names()
    if settings.format is not None and settings.format not in names:
        files = [f for f in FORMATS.values() if f.name == settings.format and f.paths]
        hint = f"; for {settings.format} use --{files[0].paths[0]} - (stdout) or --{files[0].paths[0]} PATH" \
            if files else ""
        fail(f"--format {settings.format}: use {' or '.join(names)}{hint}")


def outputs(**paths: str | None) -> None:
    """Every file the run will write: its folder exists, and the path is not a folder. `-` is stdout, which
    one output at most can have (two documents on one stream parse as neither)."""
    to_stdout = [f"--{option.replace('_', '-')} -" for option, path in paths.items() if path == "-"]
    if len(to_stdout) > 1:
        fail(f"{' and '.join(to_stdout)}: only one output can go to stdout; write the other to a file")
    for option, path in paths.items():
        if not path or path == "-":
            continue
        flag = "--" + option.replace("_", "-")
        target = Path(path).expanduser()
        if target.is_dir():
            fail(f"{flag} {path}: is a directory; give a file name")
        folder = target.parent
        if not folder.is_dir():
            fail(f"{flag} {path}: the folder '{folder}' does not exist")
        if not os.access(folder, os.W_OK):
            fail(f"{flag} {path}: the folder '{folder}' is not writable")


def baseline(settings: Settings) -> dict | None:
    """The baseline to compare with, read now (a bad file is exit 2 before the model loads); None when
    there is none yet (the run then writes it, unless --baseline-required)."""
    if not settings.baseline:
        if settings.baseline_required:
            fail("--baseline-required needs --baseline PATH")
        return None
    path = Path(settings.baseline)
    if not path.exists():
        if settings.baseline_required:
            fail(f"baseline '{settings.baseline}' does not exist (--baseline-required; create it with "
                 "--save-baseline, or drop --baseline-required to write it on this run)")
        outputs(baseline=settings.baseline)
        return None
    from posdiag.baseline import read_baseline
    from posdiag.errors import PosdiagError

    try:
        return read_baseline(path)
    except PosdiagError as exc:
        fail(str(exc))
