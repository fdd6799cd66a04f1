"""pytest plugin: a `posdiag` fixture so a model repository can put the check into its unit tests.

    def test_positions(posdiag):
        posdiag.assert_ok(build_my_model())                 # every applicable check
        posdiag.assert_ok(build_my_model(), checks=["shuffle"])
        posdiag.assert_ok(build_my_model(), require=["shuffle", "cache"])  # these must pass; the rest must not fail
        posdiag.assert_ok(build_my_model(), allow_skips=True)  # a check that could not run is accepted

By default a test passes only when every check passed or does not apply (n/a): a SKIP (not run) or a WARN (not
decided) was not judged, so it does not pass a unit test unless the test says so (allow_skips / allow_warnings).
A test that names `require` says which checks must pass: those must PASS, the others may skip or warn (a FAIL or an
internal error anywhere still fails it), unless allow_skips=False / allow_warnings=False says otherwise.

A failure shows the report (one line per check, with the numbers), not a traceback into posdiag.
Registered through the `pytest11` entry point, so installing posdiag is enough.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


class PosdiagFixture:
    """What the `posdiag` fixture hands a test."""

    def check(self, model: Any, checks: Iterable[str] | None = None, **kwargs: Any):
        from posdiag.api import check_model

        return check_model(model, checks, **kwargs)

    def assert_ok(self, model: Any, checks: Iterable[str] | None = None, *, allow_warnings: bool | None = None,
                  allow_skips: bool | None = None, fail_on: str | Iterable[str] | None = None,
                  require: str | Iterable[str] | None = None, **kwargs: Any):
        """Fail the test when the gate does not pass: a check fails, posdiag cannot run one, the policy refuses a
        result (`require`d checks that did not pass, n/a included), or a check warns or skips. Unsaid, warnings and
        skips fail the test when nothing is required (every check must pass or be n/a) and are allowed when
        `require` names the checks that must pass; allow_warnings / allow_skips decide either way. Returns the
        report."""
        named = bool(_split(require))
        statuses = set(_split(fail_on))
        if not (named if allow_warnings is None else allow_warnings):
            statuses.add("warn")
        if not (named if allow_skips is None else allow_skips):
            statuses.add("skip")
        report = self.check(model, checks, fail_on=sorted(statuses), require=require, **kwargs)
        if report.exit_code != 0:
            from posdiag.results import Status

            refused = {r.check for r in report.gate if r.kind == "policy"}
            problems = [f"  {c.status.value.upper()} {c.name}: {c.summary}" for c in report.checks
                        if c.status in (Status.FAIL, Status.ERROR) or c.name in refused]
            lines = [f"posdiag found {len(problems)} problem(s) in {report.model.id} "
                     f"({report.model.family}, positions: {report.model.position_kind}):", *problems]
            lines += [f"  gate: {r.check} {r.why}" for r in report.gate if r.kind == "policy"]
            pytest.fail("\n".join(lines), pytrace=False)
        return report


def _split(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    return [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]


@pytest.fixture
def posdiag() -> PosdiagFixture:
    return PosdiagFixture()
