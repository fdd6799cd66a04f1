"""Pasted outputs in README.md and docs/*.md are rendered from real runs by benchmarks/render_docs.py, never typed.

What the suite re-runs: every `<!-- render -->` console block (each `$ posdiag ...` on the tiny fixtures, the
planted models of tests/ and the page's config: a few seconds each) is run by tests/test_docs.py, in-process under
the script's terminal, and compared byte for byte with what the script renders; the `<!-- render: $ COMMAND -->`
block (docs/ci.md's assert_ok failure) is run here. What only the script renders: nothing else; blocks marked
`<!-- as run: WHERE, DATE; WHY -->` (the real SmolLM2 file, llama.cpp and ONNX files written first, a server,
benchmarks whose seconds are the machine's, rows of planted-bug tests) are checked here for their marker only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_docs import number_drift, render_docs  # the script, loaded once by path

TABLE_OUTPUT = """posdiag fixtures/llama-tiny  family llama · causal · positions: rope · float32 on cpu
  note: a note
check  status  summary
load   N/A     nothing stored to check
rope   WARN    module agrees with the config (worst 0.968x tolerance); all layers: target 32768 is beyond the 128
               tokens the config claims
rope: frequencies vs training length (information)
┏━━━━━━━┓
┃ where ┃
┗━━━━━━━┛
╭──────────────────╮
│ 1 n/a · 1 warn   │
│ exit code 0      │
╰──────────────────╯""".splitlines()

QUIET_OUTPUT = """N/A load: nothing stored to check
PASS shuffle: position signal far above the noise floor: residual 0.00711 = 4.93e+04x noise floor 1.4e-07 (3
permutations, 64 tokens; enters at block 1)
WARN rope: module agrees with the config
N/A table: RoPE rotates q/k by position: no table (see `rope`)
GATE FAILED — rope warn, and the gate fails on warn
fail-on warn · exit code 1""".splitlines()


def page_of(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


@pytest.mark.parametrize("page", render_docs.PAGES, ids=lambda p: p.name)
def test_every_pasted_output_is_marked(page):
    wrong = [f"{b.id}: {why}" for b in render_docs.blocks(page) for why in render_docs.problems(b)]
    assert not wrong, "\n".join(wrong)


def test_the_docs_have_rendered_and_as_run_blocks():
    found = [b for page in render_docs.PAGES for b in render_docs.marked(page)]
    rendered = [b for b in found if b.marker == "render"]
    assert len(rendered) >= 20 and {b.page.name for b in rendered} >= {"README.md", "checks.md", "ci.md",
                                                                        "devices.md"}
    assert any(b.marker == "as run" for b in found)


@pytest.mark.parametrize("text, why", [
    ("```console\n$ posdiag shuffle m -q\nFAIL shuffle: x\n```\n", "without a marker"),
    ("```text\nPASS fit: x\n```\n", "without a marker"),
    ("<!-- as run: somewhere; why -->\n```text\nPASS fit: x\n```\n", "is not 'WHERE, YYYY-MM-DD; WHY'"),
    ("<!-- render -->\n```text\n$ posdiag shuffle m -q\nPASS shuffle: x\n```\n", "a text block"),
    ("<!-- render: show=all; show=all -->\n```console\n$ posdiag shuffle m -q\nPASS shuffle: x\n```\n",
     "2 show= options for 1 commands"),
    ("<!-- render: show=header, Verdicts -->\n```console\n$ posdiag shuffle m\n```\n", "is not one of"),
    ("<!-- render: lines=3 -->\n```console\n$ posdiag shuffle m\n```\n", "unknown render option"),
])
def test_a_marker_that_does_not_parse_is_named(tmp_path, text, why):
    block = render_docs.blocks(page_of(tmp_path, text))[0]
    assert any(why in problem for problem in render_docs.problems(block)), render_docs.problems(block)


@pytest.mark.parametrize("text", [
    "<!-- render -->\n```console\n$ posdiag shuffle m -q\nPASS shuffle: x\n```\n",
    "<!-- render: show=header,verdicts; show=all -->\n```console\n$ posdiag check m\n...\n$ posdiag check m -q\n```\n",
    "<!-- render: $ python -c \"print(1)\" -->\n```text\n1\n```\n",
    "<!-- as run: one NVIDIA H200, 2026-12-04; needs a GPU -->\n```text\n$ posdiag check m --device cuda\n```\n",
    "```bash\nposdiag shuffle m\n```\n",  # a command to type, no output pasted
])
def test_a_marker_that_parses_passes(tmp_path, text):
    block = render_docs.blocks(page_of(tmp_path, text))[0]
    assert render_docs.problems(block) == []


def test_view_keeps_the_parts_asked_and_marks_each_cut():
    assert render_docs.view(TABLE_OUTPUT, ("all",)) == TABLE_OUTPUT
    assert render_docs.view(TABLE_OUTPUT, ("header", "verdicts", "panel")) == TABLE_OUTPUT[:6] + ["..."] + \
        TABLE_OUTPUT[10:]
    assert render_docs.view(TABLE_OUTPUT, ("header", "verdicts")) == TABLE_OUTPUT[:6] + ["..."]
    assert render_docs.view(TABLE_OUTPUT, ("verdicts", "rope")) == ["...", TABLE_OUTPUT[2], "...", *TABLE_OUTPUT[4:6],
                                                                     "..."]
    assert render_docs.view(QUIET_OUTPUT, ("load", "shuffle", "table")) == QUIET_OUTPUT[:3] + ["..."] + \
        QUIET_OUTPUT[4:5] + ["..."]
    assert render_docs.view(QUIET_OUTPUT, ("verdicts",)) == QUIET_OUTPUT[:5] + ["..."]
    assert render_docs.view(QUIET_OUTPUT, ("panel",)) == ["..."] + QUIET_OUTPUT[5:]


def test_drift_is_byte_exact_but_for_load_dependent_figures(tmp_path):
    text = ("<!-- render -->\n```console\n$ posdiag x\n"
            "PASS cache: error 2.29e-07 = 1.91x floor; took 3.4 s, 120 MB\n```\n")
    block = render_docs.blocks(page_of(tmp_path, text))[0]
    assert render_docs.drift(block, block.body) == ""
    assert render_docs.drift(block, [block.body[0], block.body[1].replace("3.4 s, 120 MB", "12 s, 98.5 MB")]) == ""
    moved = [block.body[0], block.body[1].replace("1.91x", "1.92x")]
    assert "1.92x" in render_docs.drift(block, moved)
    assert "renders 3" in render_docs.drift(block, block.body + ["..."])
    assert render_docs.drift(block, [block.body[0], block.body[1] + " "]) != ""
    # On other arithmetic (another SIMD path, another torch) numbers are masked, words and verdicts still exact
    assert render_docs.drift(block, moved, numbers=False) == ""
    wider = [block.body[0], "PASS cache: error 2.294e-07 = 1.912x", "floor; took 3.4 s, 120 MB"]  # wrapped elsewhere
    assert render_docs.drift(block, wider, numbers=False) == "" and "line 2" in render_docs.drift(block, wider)
    assert "FAIL" in render_docs.drift(block, [block.body[0], block.body[1].replace("PASS", "FAIL")], numbers=False)


def test_the_docs_record_the_arithmetic_they_were_rendered_on():
    """Writing records torch's version, SIMD path and the bits its kernels give: the suite compares figures byte for
    byte only there. The fingerprint is the same on every call (one thread, whatever the caller's), and leaves the
    caller's thread count as it was."""
    import re

    import torch

    assert re.fullmatch(r"torch \S+, \w+, kernels [0-9a-f]{8}", render_docs.rendered_on()), render_docs.rendered_on()
    threads = torch.get_num_threads()
    first = render_docs.kernel_fingerprint()
    torch.set_num_threads(2)
    try:
        assert render_docs.kernel_fingerprint() == first and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert render_docs.arithmetic().endswith(f", kernels {first}")


def test_the_script_rewrites_a_drifted_block_and_check_reports_drift(tmp_path, capsys):
    """A real run, in a fresh process: `posdiag --version` (instant), pasted wrong, then rendered."""
    from posdiag import __version__

    prose = "Some prose the script must not touch.\n\n"
    page = page_of(tmp_path, prose + "<!-- render -->\n```console\n$ posdiag --version\nposdiag 0.0.0\n```\nEnd.\n")
    assert render_docs.main(["--check", str(page)]) == 1
    assert "page.md:4: line 2 of the block" in capsys.readouterr().out
    assert "posdiag 0.0.0" in page.read_text(), "--check wrote"
    assert render_docs.main([str(page)]) == 0
    rendered = f"<!-- render -->\n```console\n$ posdiag --version\nposdiag {__version__}\n```\nEnd.\n"
    assert page.read_text() == prose + rendered
    assert render_docs.main(["--check", str(page)]) == 0


def test_the_script_leaves_a_block_edited_while_it_ran(tmp_path):
    page = page_of(tmp_path, "<!-- render -->\n```console\n$ posdiag --version\nposdiag 0.0.0\n```\n")
    block = render_docs.blocks(page)[0]
    page.write_text("New prose above.\n\n" + page.read_text().replace("0.0.0", "0.0.1"))
    assert render_docs.rewrite(page, [(block, ["$ posdiag --version", "posdiag 9"])]) == [block.id]
    assert "0.0.1" in page.read_text()
    moved = "New prose above.\n\n<!-- render -->\n```console\n$ posdiag --version\nposdiag 0.0.0\n```\n"
    page.write_text(moved)
    assert render_docs.rewrite(page, [(block, ["$ posdiag --version", "posdiag 9"])]) == []
    assert page.read_text() == moved.replace("0.0.0", "9")


COMMAND_ONLY = [b for page in render_docs.PAGES for b in render_docs.marked(page)
                if b.marker == "render" and b.options.startswith("$ ")]


@pytest.mark.parametrize("block", COMMAND_ONLY, ids=lambda b: b.id)
def test_blocks_of_a_command_the_page_does_not_show_are_as_rendered(block):
    """Byte for byte on the arithmetic the docs were rendered on; elsewhere words and verdicts exactly, every number
    within test_docs' factor."""
    body = render_docs.render(block)
    exact = render_docs.arithmetic() == render_docs.rendered_on()
    why = render_docs.drift(block, body, numbers=exact) or ("" if exact else number_drift(
        *(" ".join(render_docs.masked(lines)) for lines in (block.body, body))))
    assert not why, f"{block.id} ({why}): `python benchmarks/render_docs.py --only {block.id}`"
