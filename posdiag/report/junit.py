"""JUnit XML: one testcase per check, for CI systems that show test reports.

classname = the model id, name = the check. FAIL carries the summary and key numbers; SKIP is <skipped>
with its reason (never counted as passed), and so is a check that does not apply (n/a: <skipped
type="NotApplicable">); a WARN is a testcase without <skipped> whose <properties> carry status=warn and the
warning, repeated in system-out (visible, not silently passed); ERROR (posdiag could not run the check) is
<error>. A WARN or SKIP the gate policy refuses (--fail-on), or a required check that did not pass (--require), is a
<failure type="GatePolicy"> saying so; a required check that did not run gets a testcase of its own.
Characters XML 1.0 forbids are replaced.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from posdiag.results import Report, Status

_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(text: str) -> str:
    return _ILLEGAL.sub("\ufffd", str(text))


def format_junit(report: Report) -> str:
    refused = {r.check: r for r in report.gate if r.kind == "policy"}
    failures = sum(c.status is Status.FAIL or c.name in refused for c in report.checks)
    missing = [r for r in refused.values() if r.status == "missing"]
    errors = sum(c.status is Status.ERROR for c in report.checks) + (1 if report.incomplete else 0)
    skipped = sum(c.status in (Status.SKIP, Status.NA) and c.name not in refused for c in report.checks)
    suite = ET.Element("testsuite", {
        "name": "posdiag",
        "tests": str(len(report.checks) + len(missing)),
        "failures": str(failures + len(missing)),
        "errors": str(errors),
        "skipped": str(skipped),
        "time": f"{sum(c.seconds for c in report.checks):.3f}",
    })
    props = ET.SubElement(suite, "properties")
    policy = {"fail_on": ",".join(report.policy.to_dict()["fail_on"]), "require": ",".join(report.policy.require)}
    for key, value in {**report.versions, "family": report.model.family, "position_kind": report.model.position_kind,
                       **{k: v for k, v in policy.items() if v}}.items():
        ET.SubElement(props, "property", {"name": _clean(key), "value": _clean(value)})
    for check in report.checks:
        case = ET.SubElement(suite, "testcase", {
            "classname": _clean(report.model.id), "name": _clean(check.name), "time": f"{check.seconds:.3f}"})
        numbers = ", ".join(f"{k}={_fmt(v)}" for k, v in check.metrics.items())
        if check.status is Status.FAIL:
            node = ET.SubElement(case, "failure", {"message": _clean(check.summary), "type": "PositionBug"})
            node.text = _clean(f"{check.summary}\n{numbers}")
        elif check.status is Status.ERROR:
            message = f"posdiag could not run {check.name} (an internal error, not a finding; please report)"
            node = ET.SubElement(case, "error", {"message": message, "type": "InternalError"})
            node.text = _clean(check.summary)
        elif check.name in refused:
            why = refused[check.name].why
            node = ET.SubElement(case, "failure", {"message": _clean(f"{why}: {check.summary}"), "type": "GatePolicy"})
            node.text = _clean(f"{check.status.value.upper()}: {check.summary}\n{numbers}")
        elif check.status is Status.SKIP:
            node = ET.SubElement(case, "skipped", {"message": _clean(check.summary)})
            node.text = _clean(check.summary)
        elif check.status is Status.NA:
            node = ET.SubElement(case, "skipped", {"message": _clean(f"not applicable: {check.summary}"),
                                                   "type": "NotApplicable"})
            node.text = _clean(check.summary)
        else:
            if check.status is Status.WARN:
                props = ET.SubElement(case, "properties")
                ET.SubElement(props, "property", {"name": "status", "value": "warn"})
                ET.SubElement(props, "property", {"name": "warning", "value": _clean(check.summary)})
            out = ET.SubElement(case, "system-out")
            out.text = _clean(f"{check.status.value.upper()}: {check.summary}\n{numbers}")
    for reason in missing:
        case = ET.SubElement(suite, "testcase", {"classname": _clean(report.model.id), "name": _clean(reason.check)})
        ET.SubElement(case, "failure", {"message": _clean(reason.why), "type": "GatePolicy"})
    if report.incomplete:
        case = ET.SubElement(suite, "testcase", {"classname": _clean(report.model.id), "name": "incomplete"})
        ET.SubElement(case, "error", {"message": "run interrupted: not every check ran", "type": "Incomplete"})
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_junit_aborted(model: str, message: str) -> str:
    """The run ended before any check (the model did not load, an option failed against it): one testcase,
    `load`, with the error, so a CI job that uploads the JUnit file still has one that says why."""
    suite = ET.Element("testsuite", {"name": "posdiag", "tests": "1", "failures": "0", "errors": "1", "skipped": "0",
                                     "time": "0.000"})
    case = ET.SubElement(suite, "testcase", {"classname": _clean(model), "name": "load", "time": "0.000"})
    node = ET.SubElement(case, "error", {"message": _clean(message), "type": "UsageOrLoadError"})
    node.text = _clean(f"posdiag: error: {message} (exit code 2: no check ran)")
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"
