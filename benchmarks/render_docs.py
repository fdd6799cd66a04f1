"""Every pasted command output in README.md and docs/*.md, rendered from a real run, so the docs cannot drift.

    python benchmarks/render_docs.py                 # run every marked block, rewrite the outputs that changed
    python benchmarks/render_docs.py --check         # say which blocks drifted (exit 1), write nothing
    python benchmarks/render_docs.py --only ci.md    # the blocks whose id (page:line) contains this

A pasted output carries a marker, an HTML comment on the line before its fence:

    <!-- render -->                      a console block: each `$ posdiag ...` line in it is run and the output
                                         below it is what that run prints
    <!-- render: show=PARTS -->          the same, showing only PARTS of each output; `show=A; show=B` gives the
                                         first command A and the second B
    <!-- render: $ COMMAND -->           a block holding COMMAND's output alone (a command the page does not show)
    <!-- as run: WHERE, DATE; WHY -->    an output that cannot be rendered here (a GPU, a hub model, a server, a
                                         file written first): shown as pasted from WHERE on DATE (YYYY-MM-DD)

PARTS is a comma list of `header` (the model line and its notes), `verdicts` (the check table or the -q lines),
`panel` (the closing box, or -q's gate lines) and `other` (detail tables, plots); check names keep only those
checks' verdicts. Each run of lines left out is one `...` line.

Each command runs in a fresh process, as a user runs it, in a temporary directory holding `fixtures/` and `tests/`
(links to this checkout's) and the page's `[tool.posdiag]` example as pyproject.toml (a page's config example is
the config of its commands), with the terminal fixed (see TERMINAL): offline, 120 columns, no colour, one thread.
Output is compared byte for byte once figures that move with machine load (VOLATILE: seconds, memory sizes) are
masked; a block whose only difference is such a figure is left as written. tests/test_docs.py runs the same
commands in-process under the same TERMINAL and compares them with this module's `expected`, so a pasted block
that no longer matches what this script renders fails the suite. Rounding-level figures (a residual of 2.85e-16, a
ratio of two of them) depend on the arithmetic the CPU kernels take, so writing records that arithmetic (torch's
version, SIMD capability and a fingerprint of the bits its kernels give) in RENDERED_ON; on other arithmetic the
suite compares blocks with every number masked, and the figures within tests/test_docs.py's factor; where a passing
figure peaks (PEAKS: a shift, a layer) is masked there too, being as much rounding as the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "DEVELOPING.md")

# The terminal every pasted output is rendered in: rich sees a terminal (so tables wrap as a reader's would) of 120
# columns without colour or live spinners; the hub is off; one thread, so no figure depends on the core count.
TERMINAL = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "0",
            "NO_COLOR": "1", "TERM": "xterm", "COLUMNS": "120", "LINES": "50", "POSDIAG_THREADS": "1",
            "OMP_NUM_THREADS": "1"}
# Set by a caller's shell or CI and read by rich or posdiag: they would change what is printed.
UNSET = ("FORCE_COLOR", "GITHUB_ACTIONS", "JUPYTER_COLUMNS", "JUPYTER_LINES", "TTY_COMPATIBLE")
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # what NO_COLOR leaves: bold, dim, cursor show/hide
VOLATILE = {"<seconds>": re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:s|ms|min)\b"),
            "<size>": re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:[KMGT]i?B)\b")}

RENDERED_ON = ROOT / "benchmarks" / "render_docs.arithmetic"
# Where a passing summary's rounding-level figure peaks (the shift, the implementation, input and layer with the most
# rounding) moves with the CPU's kernels as the figure does: `shift`'s worst rung on fixtures/llama-tiny is 8 with
# AVX512, 4 with AVX2. Comparisons on other arithmetic mask it (the group `peak`), as they mask the figure.
PEAKS = (re.compile(r"\(floor \+ rounding term\)\s+at\s+shift\s+(?P<peak>\d+)"),  # shift: the worst rung
         re.compile(r"x\s+the\s+tolerance,\s+(?P<peak>[^()]+?)\)"),  # kernels: IMPLEMENTATION, INPUT, LAYER
         re.compile(r"x\s+noise\s+floor\s+at\s+(?P<peak>\S+)\s+\(tolerance"))  # compare's layers: the layer
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
MARKER = re.compile(r"^<!-- (render|as run)(?::\s*(.*?))?\s*-->$")
AS_RUN = re.compile(r"^(?P<where>.+?), (?P<date>\d{4}-\d{2}-\d{2}); (?P<why>.+)$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
PARTS = ("header", "verdicts", "panel", "other")
STATUSES = "PASS|FAIL|WARN|SKIP|N/A|ERROR"
QUIET_LINE = re.compile(rf"^(?:{STATUSES}) ([a-z_]+):")
TABLE_LINE = re.compile(rf"^([a-z_]+)\s+(?:{STATUSES})\s")
TABLE_HEAD = re.compile(r"^check\s+status\s+summary$")
GATE_LINE = re.compile(r"^(GATE FAILED|FAILED|posdiag could not run) |· exit code \d+$|^exit code \d+$")
# a block holding pasted output: a prompt followed by output, or a verdict line
PASTED = re.compile(rf"^\$ \S|(^|\s)(?:{STATUSES})[ :]")


@dataclass
class Command:
    line: str  # as the page shows it, without the prompt
    show: tuple[str, ...] = ("all",)
    output: list[str] = field(default_factory=list)  # as the page shows it

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.line, comments=True)


@dataclass
class Block:
    page: Path
    fence: int  # 0-based index of the opening fence line
    lang: str
    body: list[str]
    marker: str | None  # "render", "as run" or None
    options: str = ""
    indent: str = ""  # a fence inside a list item: its lines' common indent, removed from body

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.fence + 1}"

    @property
    def pasted(self) -> bool:
        return any(PASTED.search(line) for line in self.body)

    def commands(self) -> list[Command]:
        """The block's commands with what the page shows for each (a `render: $ COMMAND` block: that command)."""
        if self.options.startswith("$ "):
            return [Command(self.options[2:], output=list(self.body))]
        found: list[Command] = []
        for line in self.body:
            if line.startswith("$ "):
                found.append(Command(line[2:]))
            elif found:
                found[-1].output.append(line)
        shows = shows_of(self.options, len(found))
        for command, show in zip(found, shows, strict=True):
            command.show = show
        return found


def shows_of(options: str, count: int) -> list[tuple[str, ...]]:
    """The `show=` of each command: one for all, or one per command in order."""
    given = [o.strip() for o in options.split(";") if o.strip()]
    if not given:
        return [("all",)] * count
    for option in given:
        if not option.startswith("show="):
            raise ValueError(f"unknown render option {option!r} (show=PARTS)")
    shows = [tuple(p.strip() for p in o[len("show="):].split(",") if p.strip()) for o in given]
    if len(shows) == 1:
        return shows * count
    if len(shows) != count:
        raise ValueError(f"{len(shows)} show= options for {count} commands")
    return shows


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a page with the marker on the line before it (blank lines between allowed)."""
    lines = (page.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, m.group(1)
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        marker = MARKER.match(before)
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[start + 1:i]]
        found.append(Block(page, start, m.group(2).lower(), body, marker and marker.group(1),
                           (marker.group(2) or "") if marker else "", indent))
        i += 1
    return found


def marked(page: Path, text: str | None = None) -> list[Block]:
    return [b for b in blocks(page, text) if b.marker]


def problems(block: Block) -> list[str]:
    """What is wrong with a block's marker (empty when it parses)."""
    if block.marker is None:
        return ["pasted output without a marker (<!-- render --> or <!-- as run: WHERE, DATE; WHY -->)"] \
            if block.pasted else []
    if block.marker == "as run":
        return [] if AS_RUN.match(block.options) else [f"as run: {block.options!r} is not 'WHERE, YYYY-MM-DD; WHY'"]
    try:
        commands = block.commands()
    except ValueError as e:
        return [str(e)]
    wrong = []
    if not commands:
        wrong.append("render: no `$ posdiag` command in the block and none in the marker")
    if block.lang != ("text" if block.options.startswith("$ ") else "console"):
        wrong.append(f"render: a {block.lang or 'plain'} block")
    for command in commands:
        unknown = [p for p in command.show if p != "all" and p not in PARTS and not re.fullmatch(r"[a-z_]+", p)]
        if unknown:
            wrong.append(f"render: show {unknown} is not one of {PARTS} or a check name")
    return wrong


def parts(lines: list[str]) -> list[tuple[str, str | None]]:
    """(part, check) for each output line: header, verdicts (with the check it belongs to), panel or other."""
    labels: list[tuple[str, str | None]] = [("other", None)] * len(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        if TABLE_HEAD.match(line):
            j = i - 1
            while j >= 0 and not lines[j].startswith("posdiag "):
                j -= 1
            for k in range(j, i) if j >= 0 else ():
                labels[k] = ("header", None)
            labels[i] = ("verdicts", None)
            check, i = None, i + 1
            while i < len(lines) and (TABLE_LINE.match(lines[i]) or lines[i].startswith(" ")):
                check = m.group(1) if (m := TABLE_LINE.match(lines[i])) else check
                labels[i] = ("verdicts", check)
                i += 1
            continue
        if m := QUIET_LINE.match(line):
            labels[i], i = ("verdicts", m.group(1)), i + 1
            while i < len(lines) and not QUIET_LINE.match(lines[i]) and not GATE_LINE.search(lines[i]):
                labels[i], i = ("verdicts", m.group(1)), i + 1
            while i < len(lines) and GATE_LINE.search(lines[i]):
                labels[i], i = ("panel", None), i + 1
            continue
        if line.startswith("╭"):
            while i < len(lines) and not lines[i].startswith("╰"):
                labels[i], i = ("panel", None), i + 1
            if i < len(lines):
                labels[i] = ("panel", None)
        i += 1
    return labels


def view(lines: list[str], show: tuple[str, ...]) -> list[str]:
    """The lines `show` keeps, each run of lines left out as one `...`."""
    if "all" in show:
        return list(lines)
    checks = {p for p in show if p not in PARTS}
    kept = set(show) & set(PARTS) | ({"verdicts"} if checks else set())
    out: list[str] = []
    for line, (part, check) in zip(lines, parts(lines), strict=True):
        keep = part in kept and not (part == "verdicts" and checks and check is not None and check not in checks)
        if keep:
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def clean(stdout: str) -> list[str]:
    """A run's stdout as the page shows it: no escape sequences, no padding at line ends."""
    return [ESCAPE.sub("", line).rstrip() for line in stdout.splitlines()]


def expected(block: Block, outputs: list[str]) -> list[str]:
    """The block's body rendered from its commands' stdouts (in order)."""
    commands = block.commands()
    if block.options.startswith("$ "):
        return clean(outputs[0])
    body: list[str] = []
    for command, stdout in zip(commands, outputs, strict=True):
        body += [f"$ {command.line}"] + view(clean(stdout), command.show)
    return body


def masked(lines: list[str]) -> list[str]:
    """Lines with the figures that move with machine load replaced by their kind."""
    out = []
    for line in lines:
        for name, pattern in VOLATILE.items():
            line = pattern.sub(name, line)
        out.append(line)
    return out


@functools.lru_cache(maxsize=1)
def arithmetic() -> str:
    """What rounding-level figures depend on: torch's version, the SIMD path its CPU kernels take, and the bits those
    kernels give. The SIMD capability alone does not settle it: on two CPUs that both report AVX512 (a Sapphire Rapids
    and an older Xeon) oneDNN and MKL pick other kernels, and the docs' residuals move in their third digit."""
    import torch

    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, kernels {kernel_fingerprint()}"


def kernel_fingerprint() -> str:
    """Eight hex digits of the bits the docs' own arithmetic gives on one thread, as rendering runs it: the logits of
    fixtures/llama-tiny and fixtures/gpt2-tiny on fixed tokens, in float32 and float64, through eager attention and
    SDPA, and a cached decoding step (~1 s, once a process)."""
    import hashlib
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    threads, verbosity, bars = torch.get_num_threads(), logging.get_verbosity(), logging.is_progress_bar_enabled()
    digest = hashlib.sha256()
    ids = torch.arange(3, 3 + 2 * 24).remainder(250).reshape(2, 24)
    torch.set_num_threads(1)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        for name in ("llama-tiny", "gpt2-tiny"):
            loaded = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / name).eval()
            for model in (loaded, copy.deepcopy(loaded).double()):
                for attention in ("eager", "sdpa"):
                    model.set_attn_implementation(attention)
                    with torch.inference_mode(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the cache's keyword is renamed across transformers 5.x
                        out = model(ids[:, :-1], use_cache=True)
                        step = model(ids[:, -1:], past_key_values=out.past_key_values).logits
                    for logits in (out.logits, step):
                        digest.update(logits.contiguous().numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    return digest.hexdigest()[:8]


def rendered_on() -> str:
    return RENDERED_ON.read_text().strip() if RENDERED_ON.is_file() else ""


def without_numbers(lines: list[str]) -> list[str]:
    return [NUMBER.sub("<n>", line) for line in lines]


def without_peaks(text: str) -> str:
    """TEXT (lines joined: a peak may wrap) with the location of each rounding-level peak (PEAKS) masked."""
    for pattern in PEAKS:
        text = pattern.sub(lambda m: m.string[m.start():m.start("peak")] + "<peak>" + m.string[m.end("peak"):m.end()],
                           text)
    return text


def drift(block: Block, body: list[str], numbers: bool = True) -> str:
    """'' when the page shows `body` (volatile figures masked), else the first line that differs. Without `numbers`
    (other arithmetic) every number is masked and the words are compared, not the lines: a figure printed one digit
    wider wraps a line elsewhere."""
    shown, real = masked(block.body), masked(body)
    if not numbers:
        missing, extra = Counter(words(shown)), Counter(words(real))
        missing, extra = missing - extra, extra - missing
        return "" if not missing and not extra else (f"the block shows {sorted(missing)[:5]} the run does not print"
                                                     f" and the run prints {sorted(extra)[:5]}")
    if shown == real:
        return ""
    for n, (a, b) in enumerate(zip(shown, real, strict=False)):
        if a != b:
            return f"line {n + 1} of the block: shows {a!r}, renders {b!r}"
    return f"the block shows {len(shown)} lines, the run renders {len(real)}"


def words(lines: list[str]) -> list[str]:
    """The words of LINES with every number and peak location masked, table borders left out: what a rewrap and
    other kernels cannot change."""
    return [w for w in without_numbers([without_peaks(" ".join(lines))])[0].split() if any(c.isalnum() for c in w)]


def config_example(page: Path) -> str | None:
    """The page's `[tool.posdiag]` toml example, if it shows one."""
    for block in blocks(page):
        if block.lang == "toml" and any(line.strip() == "[tool.posdiag]" for line in block.body):
            return "\n".join(block.body) + "\n"
    return None


@contextlib.contextmanager
def workdir(config: str | None):
    """A fresh directory holding fixtures/ and tests/ (links) and the page's config."""
    with tempfile.TemporaryDirectory(prefix="posdiag-docs-") as where:
        for name in ("fixtures", "tests"):
            Path(where, name).symlink_to(ROOT / name, target_is_directory=True)
        if config:
            Path(where, "pyproject.toml").write_text(config)
        yield Path(where)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(TERMINAL)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run(line: str, where: Path) -> str:
    """One command's stdout, run in a fresh process (`posdiag` as `python -m posdiag`)."""
    argv = shlex.split(line, comments=True)
    if argv[0] == "posdiag":
        argv = [sys.executable, "-m", "posdiag", *argv[1:]]
    elif argv[0] == "python":
        argv[0] = sys.executable
    done = subprocess.run(argv, cwd=where, env=environment(), capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, 1):  # no page shows a usage error or a crash: the run itself went wrong
        raise RuntimeError(f"`{line}` exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def render(block: Block) -> list[str]:
    """The block's body from a real run of its commands (in one directory, in order: a later one may read what an
    earlier one wrote)."""
    with workdir(config_example(block.page)) as where:
        return expected(block, [run(c.line, where) for c in block.commands()])


def rewrite(page: Path, changes: list[tuple[Block, list[str]]]) -> list[str]:
    """Give each rendered block its new body. The page is read afresh (it may have been edited while the commands
    ran): a block is found again by its marker and old body, the one nearest its old place; only its fenced lines
    are touched. Returns the ids of blocks no longer found as rendered (left alone)."""
    text = page.read_text()
    lines, now, lost, edits = text.splitlines(), blocks(page, text), [], []
    for old, body in changes:
        same = [b for b in now if b.marker == old.marker and b.options == old.options and b.body == old.body]
        if not same:
            lost.append(old.id)
            continue
        block = min(same, key=lambda b: abs(b.fence - old.fence))
        edits.append((block.fence, len(block.body), [(block.indent + line).rstrip() for line in body]))
    for fence, length, body in sorted(edits, reverse=True):
        lines[fence + 1:fence + 1 + length] = body
    page.write_text("\n".join(lines) + ("\n" if text.endswith("\n") else ""))
    return lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to render (default: README.md and docs/*.md)")
    parser.add_argument("--check", action="store_true", help="report drift, write nothing (exit 1 on drift)")
    parser.add_argument("--only", default="", help="only the blocks whose id (page:line) contains this")
    args = parser.parse_args(argv)
    drifted = 0
    for page in [p.resolve() for p in args.pages] or PAGES:
        changes = []
        for block in blocks(page):
            for problem in problems(block):
                print(f"{block.id}: {problem}", flush=True)
                drifted += 1
            if block.marker != "render" or args.only not in block.id or problems(block):
                continue
            try:
                body = render(block)
            except RuntimeError as e:
                print(f"{block.id}: not rendered: {e}", flush=True)
                drifted += 1
                continue
            why = drift(block, body)
            print(f"{block.id}: {why or 'as rendered'}", flush=True)
            if why:
                drifted += 1
                changes.append((block, body))
        if not args.check and not args.only and args.pages == []:
            RENDERED_ON.write_text(arithmetic() + "\n")
        if changes and not args.check:
            for lost in rewrite(page, changes):
                print(f"{lost}: edited while it was rendered, left as it was: run again", flush=True)
    if args.check and drifted:
        print(f"{drifted} block(s) drifted or unmarked: `python benchmarks/render_docs.py` renders them")
    return 1 if args.check and drifted else 0


if __name__ == "__main__":
    sys.exit(main())
