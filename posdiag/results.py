"""Results are data: frozen dataclasses that checks return and renderers consume.

Nothing here prints. `Report.exit_code` is decided here, not in the CLI, so tests can
reach it without running a command.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


class Status(str, enum.Enum):
    """Outcome of one check. Order matters: later is worse for `worst()`.

    NA ("n/a"): the check does not apply to this model by design (`table` on a RoPE model, `cache` on a model that
    keeps no cache): nothing to judge, so neither a pass nor a skip (a skip is a check that applies and could not
    run). It never fails the gate, except for a check the policy requires to pass.
    """

    PASS = "pass"
    NA = "n/a"
    SKIP = "skip"
    WARN = "warn"
    FAIL = "fail"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @staticmethod
    def worst(statuses: list[Status]) -> Status:
        """The most severe status (n/a is the least: one stack that applies decides); an empty list is a SKIP."""
        return max(statuses, key=lambda s: s.rank) if statuses else Status.SKIP


_RANK = {Status.NA: -1, Status.PASS: 0, Status.SKIP: 1, Status.WARN: 2, Status.FAIL: 3, Status.ERROR: 4}


@dataclass(frozen=True)
class Table:
    """A small table a check wants shown (per-layer residuals, per-step errors...)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.columns), "rows": [list(r) for r in self.rows]}


@dataclass(frozen=True)
class CheckResult:
    """What one check found.

    name:    stable check name (`shuffle`, `load`, ...), used by --only/--skip, JSON and JUnit.
    status:  the verdict.
    summary: one line a person can act on, with the number behind the verdict.
    metrics: the numbers that decided the verdict (residual, noise_floor, ratio, tolerance...).
    details: everything else worth keeping (per-permutation numbers, reasons, where it went wrong).
    tables:  tables for the console renderer; also serialised into JSON details.
    """

    name: str
    status: Status
    summary: str
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    tables: tuple[Table, ...] = ()
    seconds: float = 0.0
    forward_passes: int = 0

    def to_dict(self) -> dict[str, Any]:
        details = dict(self.details)
        if self.tables:
            details["tables"] = [t.to_dict() for t in self.tables]
        return {
            "name": self.name,
            "status": self.status.value,
            "summary": self.summary,
            "metrics": jsonable(self.metrics),
            "details": jsonable(details),
            "seconds": round(self.seconds, 4),
            "forward_passes": self.forward_passes,
        }


def combine_stacks(name: str, per_stack: list[CheckResult]) -> CheckResult:
    """One result for a model's stacks (an encoder-decoder has two): the worst verdict, every
    stack's numbers prefixed by its name, the summaries joined. A single stack is returned as is."""
    if len(per_stack) == 1:
        return per_stack[0]
    worst = max(per_stack, key=lambda r: r.status.rank)
    metrics = dict(worst.metrics)
    for r in per_stack:
        metrics.update({f"{r.details.get('stack')}_{k}": v for k, v in r.metrics.items()})
    return CheckResult(
        name, worst.status,
        "; ".join(f"{r.details.get('stack')}: {r.summary}" for r in per_stack),
        metrics,
        {"stacks": {r.details.get("stack"): r.details for r in per_stack}},
        tuple(t for r in per_stack for t in r.tables),
    )


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, as the report states it."""

    id: str
    family: str
    kind: str  # causal | encoder | seq2seq
    position_kind: str  # rope | learned | sinusoidal | alibi | relative_bias | none found
    dtype: str
    device: str
    check_dtype: str = ""  # the dtype equivariance checks ran in (after upcasting)
    source: str = ""  # what files were read (safetensors / pickle / factory / in-memory)
    notes: tuple[str, ...] = ()
    model_class: str = ""  # the Python class the checks ran on
    shipped_code: dict[str, str] = field(default_factory=dict)  # the checkpoint's own code (config auto_map)
    untested_code: str = ""  # why the checks did not run that code ('' when they did, or there is none)
    tested: str = ""  # which part of a multimodal model the checks ran on ("" : the whole model)

    @property
    def causal(self) -> bool:
        return self.kind in ("causal", "seq2seq")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "family": self.family,
            "kind": self.kind,
            "position_kind": self.position_kind,
            "causal": self.causal,
            "dtype": self.dtype,
            "check_dtype": self.check_dtype or self.dtype,
            "device": self.device,
            "source": self.source,
            "tested": self.tested,
            "notes": list(self.notes),
            "class": self.model_class,
            "shipped_code": ({"auto_map": dict(self.shipped_code), "tested": not self.untested_code,
                              "not_tested_because": self.untested_code or None} if self.shipped_code else None),
        }


@dataclass(frozen=True)
class GatePolicy:
    """What fails the gate besides a FAIL (`--fail-on`, `--require`).

    fail_on: statuses that also fail the gate: WARN (a check that could not decide) and/or SKIP (a check
             that did not run on this model). ERROR never needs listing: it always ends non-zero (exit 3).
    require: checks that must PASS: one that warns, skips, fails or did not run at all fails the gate.
    """

    fail_on: frozenset[Status] = frozenset()
    require: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        extra = set(self.fail_on) - GATEABLE
        if extra:
            raise ValueError(f"fail_on takes {' and '.join(s.value for s in sorted(GATEABLE, key=lambda s: s.rank))} "
                             f"only, not {', '.join(sorted(s.value for s in extra))}")

    @property
    def strict(self) -> bool:
        """True when the policy asks more than 'no FAIL'."""
        return bool(self.fail_on or self.require)

    def describe(self) -> str:
        """`fail-on warn,skip · require cache`, as typed on the command line ('' for the default policy)."""
        parts = []
        if self.fail_on:
            parts.append("fail-on " + ",".join(s.value for s in sorted(self.fail_on, key=lambda s: s.rank)))
        if self.require:
            parts.append("require " + ",".join(self.require))
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"fail_on": sorted(s.value for s in self.fail_on), "require": list(self.require)}


GATEABLE = frozenset({Status.WARN, Status.SKIP})


@dataclass(frozen=True)
class GateReason:
    """One reason the gate did not pass.

    check:   the check's name.
    status:  its Status value, or "missing" for a required check that did not run.
    kind:    finding (a FAIL: a position bug) | policy (refused by --fail-on / --require) |
             internal (an ERROR: posdiag could not run the check; a posdiag bug, not a finding).
    why:     a few words: "fail", "required, but skip", "warn, and the gate fails on warn"...
    summary: the check's own one line (for an internal error: the exception, one line).
    """

    check: str
    status: str
    kind: str
    why: str
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status, "kind": self.kind, "why": self.why,
                "summary": self.summary}


INTERRUPTED = 130  # 128 + SIGINT: the exit code of an interrupted run, in its report as on the command line


@dataclass(frozen=True)
class Report:
    """A finished run: the model, every check's result, and the gate policy it is judged by."""

    model: ModelInfo
    checks: tuple[CheckResult, ...]
    versions: dict[str, str] = field(default_factory=dict)
    incomplete: bool = False
    policy: GatePolicy = field(default_factory=GatePolicy)

    @property
    def status(self) -> Status:
        return Status.worst([c.status for c in self.checks])

    @property
    def gate(self) -> tuple[GateReason, ...]:
        """Every reason the gate fails, in check order: FAILs (findings), statuses the policy refuses,
        required checks that did not pass or did not run, and ERRORs (posdiag could not run the check)."""
        reasons = []
        for c in self.checks:
            required = c.name in self.policy.require
            if c.status is Status.FAIL:
                reasons.append(GateReason(c.name, c.status.value, "finding", "fail", c.summary))
            elif c.status is Status.ERROR:
                reasons.append(GateReason(c.name, c.status.value, "internal", "internal error",
                                          str(c.details.get("error") or c.summary)))
            elif c.status in self.policy.fail_on or (required and c.status is not Status.PASS):
                why = (f"required, but {c.status.value}" if required
                       else f"{c.status.value}, and the gate fails on {c.status.value}")
                reasons.append(GateReason(c.name, c.status.value, "policy", why, c.summary))
        ran = {c.name for c in self.checks}
        reasons += [GateReason(name, "missing", "policy", "required, but it did not run", "")
                    for name in self.policy.require if name not in ran]
        return tuple(reasons)

    @property
    def exit_code(self) -> int:
        """0: the gate passed (no FAIL; warnings and skips allowed unless the policy refuses them);
        1: a check failed, or the policy refused a status or a required check did not pass;
        3: posdiag could not run a check (an internal error, not a finding) and nothing else failed the gate;
        130: the run was interrupted (Ctrl-C), as the shell reports a process ended by SIGINT, so the report
        and the command's exit status agree."""
        if self.incomplete:
            return INTERRUPTED
        kinds = {r.kind for r in self.gate}
        if kinds & {"finding", "policy"}:
            return 1
        return 3 if "internal" in kinds else 0

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        from posdiag._version import __version__

        return {
            "schema": SCHEMA_VERSION,
            "posdiag": __version__,
            "versions": dict(self.versions),
            "model": self.model.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
            "incomplete": self.incomplete,
            "policy": self.policy.to_dict(),
            "gate": {"passed": self.exit_code == 0, "reasons": [r.to_dict() for r in self.gate]},
            "exit_code": self.exit_code,
        }


def jsonable(value: Any) -> Any:
    """Plain JSON types only: floats stay floats (NaN/Inf as strings), tuples become lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Status):
        return value.value
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    try:  # numpy / torch scalars
        return jsonable(value.item())
    except Exception:
        return str(value)
