"""The HTML report (`--html`): one self-contained page, parsed here with the standard library's parser and, where
Debian's chromium is installed, rendered by a real headless browser. A planted FAIL shows its error against
position with the floor, the tolerance and the first failing position marked; its healthy twin marks none."""

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import plants_cache
import pytest
from plants_compare import copy_of, interleave_qk
from typer.testing import CliRunner

from posdiag.api import run_checks, versions
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.ports.layers import compare_subjects
from posdiag.report.formats import FORMATS
from posdiag.report.html import format_html
from posdiag.results import Report, Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 4}})
EVIL = "org/<model> & \"co\""


class Page(HTMLParser):
    """The elements of a page: (tag, attributes, the stack of (tag, attributes) it sits in); text per section."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict, tuple]] = []
        self.stack: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs, tuple(self.stack)))
        if tag not in ("br", "meta", "circle", "line", "rect", "polyline"):
            self.stack.append((tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), tuple(self.stack)))

    def handle_endtag(self, tag):
        if any(t == tag for t, _ in self.stack):
            while self.stack.pop()[0] != tag:
                pass

    def handle_data(self, data):
        self.text.append(data)

    def sections(self) -> dict[str, str]:
        return {a["data-check"]: a["data-status"] for t, a, _ in self.elements if t == "section" and "data-check" in a}

    def inside(self, check: str) -> list[tuple[str, dict]]:
        """Every element inside the section of CHECK."""
        return [(t, a) for t, a, stack in self.elements
                if any(st == "section" and sa.get("data-check") == check for st, sa in stack)]


def classes(attrs: dict) -> set[str]:
    return set((attrs.get("class") or "").split())


def cache_report(family: str, planted: bool) -> Report:
    model = zoo.tiny_model(family)
    if planted:
        model = plants_cache.rotate_decode_off_by_one(model)
    return run_checks(from_module(model, name=EVIL), ["shuffle", "cache"], OPTIONS)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_planted_fail_is_plotted_with_its_first_failing_position_and_the_healthy_twin_is_not(family):
    for planted in (True, False):
        report = cache_report(family, planted)
        page = Page(format_html(report))
        assert page.sections() == {c.name: c.status.value for c in report.checks}  # one section per check
        assert page.sections()["cache"] == ("fail" if planted else "pass")
        inside = page.inside("cache")
        svg = [a for t, a in inside if t == "svg"]
        assert len(svg) == 1, "one plot of the cached paths' error against position"
        levels = {c for t, a in inside if t == "line" for c in classes(a)}
        assert {"level", "floor", "tolerance"} <= levels
        marked = [a for t, a in inside if t == "g" and "first-failing" in classes(a)]
        if planted:  # decode steps from position 8 (a 12-token probe, 4 decode steps) are off by one
            assert len(marked) == 1
            first = float(marked[0]["data-x"])
            paths = report.check("cache").details["paths"]
            decode = paths["dynamic/decode"]
            assert decode["status"] == "fail"
            starts = [end - 1 for (_, end), err in zip(decode["steps"], decode["step_errors"], strict=True)
                      if err > report.check("cache").metrics["tolerance"]]
            assert first == min(starts)
            assert first >= decode["steps"][0][1]  # after the prefill: the decode steps are what fails
        else:
            assert marked == [], "a healthy PASS marks no failing position"
        # shuffle's residual against the floor, layer by layer
        assert any(t == "svg" for t, _ in page.inside("shuffle"))


def test_the_page_is_self_contained_and_escapes_what_it_shows():
    report = cache_report("llama", planted=True)
    text = FORMATS["html"].format(report)
    page = Page(text)
    for tag, attrs, _ in page.elements:
        assert tag not in ("script", "link", "img", "iframe", "object", "embed"), tag
        for name in set(attrs) & {"src", "href", "xlink:href", "srcset", "action"}:
            value = attrs[name] or ""
            assert not value.startswith(("http:", "https:", "//")), (tag, name, value)
            assert name != "href" or value.startswith("#"), value  # links stay on the page
    assert "http://" not in text and "https://" not in text and "@import" not in text and "url(" not in text
    assert EVIL not in text  # never raw
    assert "org/&lt;model&gt; &amp; &quot;co&quot;" in text
    assert not any(tag == "model" for tag, _, _ in page.elements)  # the id's <model> never became an element
    assert EVIL in "".join(page.text)  # and reads as typed
    assert "position bug found by cache" in "".join(page.text)  # the verdict, as the terminal words it
    assert f"exit code {report.exit_code}" in "".join(page.text)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compare_marks_the_onset_of_a_planted_port_bug_and_not_a_copy(family):
    ref = zoo.tiny_model(family)
    for candidate, status in ((interleave_qk(ref), Status.FAIL), (copy_of(ref), Status.PASS)):
        comparison = compare_subjects(from_module(ref, name="reference"), from_module(candidate, name="candidate"),
                                      RunOptions(seq_len=32))
        result = comparison.result
        assert result.status is status, result.summary
        page = Page(format_html(Report(from_module(ref, name="reference").info, (result,), versions())))
        assert "reference" in "".join(page.text) and "candidate" in "".join(page.text)  # compare's own header
        inside = page.inside("compare")
        assert any(t == "svg" for t, _ in inside)
        assert any("tolerance" in classes(a) for t, a in inside if t == "line")
        marked = [a for t, a in inside if t == "g" and "first-failing" in classes(a)]
        if status is Status.FAIL:
            assert [float(a["data-x"]) for a in marked] == [float(result.details["onset_position"])]
        else:
            assert marked == []


def test_html_on_the_command_line(fixtures_dir, tmp_path):
    from posdiag.cli import app

    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["shuffle", str(fixtures_dir / "llama-tiny"), "--html", str(out), "-q"])
    assert result.exit_code == 0, result.output
    page = Page(out.read_text())
    assert page.sections() == {"shuffle": "pass"}
    assert any(t == "svg" for t, _ in page.inside("shuffle"))


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium); the page is still "
                                              "parsed by the tests above")
def test_a_headless_browser_renders_the_page(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(format_html(cache_report("llama", planted=True)))
    shot = tmp_path / "report.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1200,2400",
             f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = Page(dom.stdout)  # the DOM the browser built: every section and plot survived its parser
    assert parsed.sections()["cache"] == "fail"
    assert any(t == "g" and "first-failing" in classes(a) for t, a in parsed.inside("cache"))
    shotted = subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True,
                             text=True, timeout=120)
    assert shotted.returncode == 0, shotted.stderr[-2000:]
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000
