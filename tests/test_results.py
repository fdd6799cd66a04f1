import json
import math

from posdiag.report.json_report import format_json
from posdiag.results import CheckResult, ModelInfo, Report, Status, Table

MODEL = ModelInfo(id="m", family="llama", kind="causal", position_kind="rope", dtype="float32", device="cpu")


def report(*statuses, incomplete=False):
    checks = tuple(CheckResult(f"c{i}", s, "x") for i, s in enumerate(statuses))
    return Report(model=MODEL, checks=checks, incomplete=incomplete)


def test_exit_codes_follow_the_contract():
    assert report(Status.PASS, Status.WARN, Status.SKIP).exit_code == 0
    assert report(Status.PASS, Status.FAIL).exit_code == 1
    assert report(Status.ERROR).exit_code == 3  # posdiag could not run a check: not a finding
    assert report(Status.ERROR, Status.FAIL).exit_code == 1
    assert report(Status.PASS, incomplete=True).exit_code == 130


def test_worst_status():
    assert Status.worst([Status.PASS, Status.WARN, Status.SKIP]) is Status.WARN
    assert Status.worst([]) is Status.SKIP


def test_json_schema_shape_and_non_finite_numbers():
    result = CheckResult("shuffle", Status.FAIL, "s", metrics={"residual": float("nan"), "ratio": 1.5},
                         tables=(Table("t", ("a",), ((1,),)),))
    data = json.loads(format_json(Report(model=MODEL, checks=(result,), versions={"torch": "x"})))
    assert data["schema"] == 1
    assert data["model"]["causal"] is True and data["model"]["position_kind"] == "rope"
    check = data["checks"][0]
    assert check["status"] == "fail" and check["metrics"]["residual"] == "nan"
    assert check["details"]["tables"][0]["rows"] == [[1]]
    assert data["exit_code"] == 1
    assert not math.isnan(check["metrics"]["ratio"])
