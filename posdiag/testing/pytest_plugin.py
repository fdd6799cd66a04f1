"""pytest plugin: a `posdiag` fixture so a model repository can put the check into its unit tests.

    def test_positions(posdiag):
        posdiag.assert_ok(build_my_model())                 # every applicable check
        posdiag.assert_ok(build_my_model(), checks=["shuffle"])
        posdiag.assert_ok(build_my_model(), require=["shuffle", "cache"])  # these must pass, not only not fail
        posdiag.assert_ok(build_my_model(), allow_skips=True)  # a check that could not run is accepted

By default a test passes only when every check passed or does not apply (n/a): a SKIP (not run) or a WARN (not
decided) was not judged, so it does not pass a unit test unless the test says so (allow_skips / allow_warnings).

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

    def assert_ok(self, model: Any, checks: Iterable[str] | None = None, *, allow_warnings: bool = False,
                  allow_skips: bool = False, fail_on: str | Iterable[str] | None = None,
                  require: str | Iterable[str] | None = None, **kwargs: Any):
        """Fail the test when the gate does not pass: a check fails, posdiag cannot run one, a check warns or
        skips (unless allow_warnings / allow_skips), or the policy refuses a result (`require`d checks that did
        not pass, n/a included). Returns the report."""
        statuses = set(_split(fail_on)) | (set() if allow_warnings else {"warn"}) | (set() if allow_skips else
                                                                                     {"skip"})
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
