"""The steps the model commands share: load MODEL, build the run options, tokenize --text, and emit
the report where the settings say (its exit code is the command's). Heavy imports stay inside."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from posdiag.cli._io import console_for, interrupted, write_output
from posdiag.cli.options import Settings, load_options

if TYPE_CHECKING:
    from rich.console import Console


def quiet_transformers() -> None:
    """transformers' own progress bars and missing-key warnings, accelerate's offload warning, the hub
    client's retries: posdiag reports those itself (the `load` check, the device-map note, one line
    when the hub cannot be reached)."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry lines: posdiag says "cannot fetch" once


def load_model(settings: Settings):
    """Load settings.model as a Subject (raises PosdiagError; callers guard)."""
    from posdiag.model.loading import load_subject

    quiet_transformers()
    return load_subject(settings.model, load_options(settings))


def run_options(settings: Settings, subject: Any):
    """RunOptions for the checks, validated against the loaded model (probe length, --text ids)."""
    from posdiag.errors import PosdiagError
    from posdiag.options import RunOptions, probe_length

    token_ids = None
    if settings.text:
        token_ids = tokenize(settings.model, text_of(settings.text), settings.revision,
                             bool(settings.trust_remote_code))
    options = RunOptions(seq_len=settings.seq_len, seed=settings.seed, permutations=settings.permutations,
                         token_ids=token_ids, check_options=dict(settings.check_options),
                         compile=bool(settings.compile))
    probe_length(subject, options)  # validate the length against the declared context now, before any check
    if token_ids is not None and any(t >= subject.vocab_size for t in token_ids):
        raise PosdiagError("the tokenizer produced ids outside the model's vocabulary")
    return options


def text_of(value: str) -> str:
    """--text is the text itself, or the path of a UTF-8 file holding it (`fit` scores a document this way)."""
    from pathlib import Path

    from posdiag.errors import PosdiagError

    path = Path(value)
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:  # longer than a file name may be (ENAMETOOLONG): the text itself
        is_file = False
    if not is_file:
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PosdiagError(f"--text {value}: cannot read it as UTF-8 text ({type(exc).__name__})") from None


def tokenize(model: str, text: str, revision: str | None, trust_remote_code: bool) -> tuple[int, ...]:
    """--text through MODEL's tokenizer (no special tokens); at least 4 ids."""
    from posdiag.errors import PosdiagError

    try:
        from transformers import AutoTokenizer

        if model.lower().endswith(".gguf") and os.path.isfile(model):  # the tokenizer stored in the file
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                                      gguf_file=os.path.basename(model))
        else:
            tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception:
        raise PosdiagError(f"--text needs a tokenizer, and none loads for '{model}' (drop --text to probe with random "
                           "ids)") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 4:
        raise PosdiagError(f"--text gives {len(ids)} tokens; the probes need at least 4")
    return tuple(int(i) for i in ids)


def emit(report, settings: Settings, *, baseline: tuple[str, Any] | None = None,
         show: Callable[[Console], None] | None = None) -> NoReturn:
    """Show the console view (the checks' table, or SHOW's view: `compare`'s), write the --format chosen beside it
    and every file asked for (an interrupted run's too, marked incomplete); the exit code is the report's, 130 when
    interrupted. baseline: (path, report) of a first run's baseline to write."""
    from posdiag.report.formats import CONSOLE

    out = console_for(settings.json, settings.junit, settings.save_baseline)
    if show is None:
        CONSOLE.show(report, out, quiet=settings.quiet)
    else:
        show(out)
    write_reports(report, settings, baseline=baseline)
    if report.incomplete:
        interrupted()
    raise typer.Exit(report.exit_code)


def write_reports(report, settings: Settings, *, baseline: tuple[str, Any] | None = None,
                  own: tuple[str, ...] = ()) -> None:
    """The --format chosen (beside the console view) and every report file the settings ask for, each from the
    registry of report/formats.py; OWN names formats the command writes its own way (`rope`'s JSON)."""
    from posdiag.report.formats import CONSOLE, FORMATS, default_stream

    chosen = settings.format or default_stream()
    files = (settings.json, settings.junit, settings.save_baseline)  # one of them at most is `-` (validate.outputs)
    writes: dict[str, str] = {}
    for fmt in FORMATS.values():
        if fmt.name in own:
            continue
        if fmt.stream and fmt.name == chosen and fmt is not CONSOLE:
            (sys.stderr if "-" in files else sys.stdout).write(fmt.format(report))
        for path in filter(None, (getattr(settings, key, None) for key in fmt.paths)):
            writes[path] = fmt.format(report)
    if baseline:
        writes[baseline[0]] = FORMATS["json"].format(baseline[1])
    for path, text in writes.items():
        write_output(path, text, settings.debug)


def show_config(settings: Settings) -> None:
    """The effective settings of this command, where each came from, and the per-check tables."""
    from rich.table import Table

    table = Table(title=f"effective configuration (file: {settings.config_file or 'none'})", title_justify="left")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("from")
    hidden = {"debug", "quiet", "show_config", "config"}
    for key, source in settings.sources.items():
        if key not in hidden:
            table.add_row(key.replace("_", "-"), repr(getattr(settings, key)), source)
    for name, opts in settings.check_options.items():
        for key, value in opts.items():
            table.add_row(f"checks.{name}.{key}", repr(value), "config file")
    console_for().print(table)
