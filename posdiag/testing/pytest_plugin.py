"""pytest plugin: a `posdiag` fixture so a model repository can put the check into its unit tests.

    def test_positions(posdiag):
        posdiag.assert_ok(build_my_model())                 # every applicable check
        posdiag.assert_ok(build_my_model(), checks=["shuffle"])

A failure shows the report (one line per check, with the numbers), not a traceback into posdiag.
Registered through the `pytest11` entry point, so installing posdiag is enough.
"""

from __future__ import annotations

from typing import Any, Iterable

import pytest


class PosdiagFixture:
    """What the `posdiag` fixture hands a test."""

    def check(self, model: Any, checks: Iterable[str] | None = None, **kwargs: Any):
        from posdiag.api import check_model

        return check_model(model, checks, **kwargs)

    def assert_ok(self, model: Any, checks: Iterable[str] | None = None, *, allow_warnings: bool = True, **kwargs: Any):
        """Fail the test when any check fails (or warns, with allow_warnings=False). Returns the report."""
        from posdiag.results import Status

        report = self.check(model, checks, **kwargs)
        bad = {Status.FAIL, Status.ERROR} | (set() if allow_warnings else {Status.WARN})
        failed = [c for c in report.checks if c.status in bad]
        if failed:
            lines = [f"posdiag found {len(failed)} problem(s) in {report.model.id} "
                     f"({report.model.family}, positions: {report.model.position_kind}):"]
            lines += [f"  {c.status.value.upper()} {c.name}: {c.summary}" for c in failed]
            pytest.fail("\n".join(lines), pytrace=False)
        return report


@pytest.fixture
def posdiag() -> PosdiagFixture:
    return PosdiagFixture()
