"""JUnit XML: one testcase per check, for CI systems that show test reports.

classname = the model id, name = the check. FAIL/ERROR carry the summary and key numbers;
SKIP is <skipped> (never counted as passed). Characters XML 1.0 forbids are replaced.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from posdiag.results import Report, Status

_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(text: str) -> str:
    return _ILLEGAL.sub("\ufffd", str(text))


def format_junit(report: Report) -> str:
    failures = sum(c.status is Status.FAIL for c in report.checks)
    errors = sum(c.status is Status.ERROR for c in report.checks) + (1 if report.incomplete else 0)
    skipped = sum(c.status is Status.SKIP for c in report.checks)
    suite = ET.Element("testsuite", {
        "name": "posdiag",
        "tests": str(len(report.checks)),
        "failures": str(failures),
        "errors": str(errors),
        "skipped": str(skipped),
        "time": f"{sum(c.seconds for c in report.checks):.3f}",
    })
    props = ET.SubElement(suite, "properties")
    for key, value in {**report.versions, "family": report.model.family, "position_kind": report.model.position_kind}.items():
        ET.SubElement(props, "property", {"name": _clean(key), "value": _clean(value)})
    for check in report.checks:
        case = ET.SubElement(suite, "testcase", {
            "classname": _clean(report.model.id), "name": _clean(check.name), "time": f"{check.seconds:.3f}"})
        numbers = ", ".join(f"{k}={_fmt(v)}" for k, v in check.metrics.items())
        if check.status is Status.FAIL:
            node = ET.SubElement(case, "failure", {"message": _clean(check.summary), "type": "PositionBug"})
            node.text = _clean(f"{check.summary}\n{numbers}")
        elif check.status is Status.ERROR:
            node = ET.SubElement(case, "error", {"message": _clean(check.summary), "type": "CheckError"})
            node.text = _clean(check.summary)
        elif check.status is Status.SKIP:
            ET.SubElement(case, "skipped", {"message": _clean(check.summary)})
        else:
            out = ET.SubElement(case, "system-out")
            out.text = _clean(f"{check.status.value.upper()}: {check.summary}\n{numbers}")
    if report.incomplete:
        case = ET.SubElement(suite, "testcase", {"classname": _clean(report.model.id), "name": "incomplete"})
        ET.SubElement(case, "error", {"message": "run interrupted: not every check ran", "type": "Incomplete"})
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
