"""Judging a half-precision checkpoint as stored, at a cost near its float32 check.

A bfloat16 forward on a CPU without native bfloat16 costs several float32 forwards (a 256-token forward of the real
SmolLM2 on an AMD EPYC with AVX2 only: 3.0 s in float32, 20.8 s in bfloat16), and a bfloat16 floor is too coarse to
see a one-position slip, so every bfloat16 verdict also needed a float64 re-run: the whole `check` cost 6x its
float32 twin. Yet a position-logic bug (a continuation numbered one early, a padded row offset by its padding) is
the same bug in every dtype, and float32 sees it at thousands of floors. So the plan:

- **Decided in float32** (`DECIDED_IN_FLOAT32`): the checks judge the function with exactly the stored weights held
  in float32 (`conversion.retyped`: a bfloat16 value is a float32 value, so nothing is rounded; buffers kept in
  float32 on purpose stay so), with float32's one-position slip at full power and float64 re-runs only where float32
  does not pass, as for a float32 checkpoint.
- **Their stored-dtype path once** (`STORED_PASS`): the same check runs again with the weights as stored, on its
  path where half precision computes differently (a padded batch, a cache) once, on a 32-token probe, without the
  slip or float64 re-runs (the float32 run has both). What rounding reaches stays near its floor; a path that stands
  AS_RUN_RATIO floors or more above it computes something else in the stored dtype (a padding mask dropped on the
  bfloat16 path only: 44-47x): FAIL, "a bug in bfloat16 only".
- **As stored** (everything else): where a bug of the dtype itself lives, as before: `rope` (the angles as the model
  computes them), `shift` (positions rounded before the angles at large positions: decided in float64, then read as
  run), `kernels` (the attention kernels in the dtype they run in), `table`, `load`.

Where the weights cannot be held in float32 (an accelerate-dispatched model; not enough free memory for the copy),
every check runs as stored, decided by float64 re-runs, as `--no-upcast` always did, and the report says so.
Measured (benchmarks/half_cost.py, AVX2 kernels, one thread each, side by side): the real SmolLM2's whole `check`
stored in bfloat16 took 1.38x its float32 twin (3.8x before: 643 s against 168 s).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from posdiag.model import precision
from posdiag.model.conversion import retyped
from posdiag.model.subject import Subject
from posdiag.model.tensors import release_freed_memory
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status
from posdiag.verdict import AS_RUN_RATIO, LOW_PRECISION

# Checks whose verdict is about position logic or the weights, decided in float32 where the stored dtype is half.
DECIDED_IN_FLOAT32 = ("shuffle", "positions", "batch", "cache", "generate", "state", "serving", "causal", "fit")
# Of those, the ones whose paths run once more as stored: two computations that must agree, read as run. A bfloat16
# forward costs 3-7 float32 ones on a CPU without native bfloat16, so the stored pass is each check's path where half
# precision computes differently (a padded batch: masks filled with the dtype's minimum; a cache kept in the stored
# dtype) once, on a probe of STORED_SEQ_LEN tokens: its settings here.
STORED_PASS = {
    "batch": {},  # one padded batch forward and its rows alone
    "cache": {"decode_steps": 4},
    "generate": {"new_tokens": 3},
    "state": {"sequences": ["one request after a padded batch"], "new_tokens": 3},
    "serving": {"paths": ["padded batch"], "decode_steps": 2, "new_tokens": 3},
    "causal": {"positions": 16},
}
AGREEMENT = tuple(STORED_PASS)
STORED_SEQ_LEN = 32


def plan(subject: Subject, name: str) -> str:
    """How `name` runs on this subject: "as stored", "float32" (decided in float32 only) or "float32+stored" (decided
    in float32, its paths once more as stored)."""
    if subject.dtype_name not in LOW_PRECISION or name not in DECIDED_IN_FLOAT32:
        return "as stored"
    if precision.float32_copy_refused(subject):
        return "as stored"
    return "float32+stored" if name in AGREEMENT else "float32"


def run_planned(subject: Subject, name: str, run: Callable[[RunOptions], CheckResult], options: RunOptions,
                reset: Callable[[], None] = lambda: None) -> CheckResult:
    """`run(options)` (the check) as the plan says: as stored; decided in float32; or decided in float32 and its
    stored-dtype path once (stored_pass_options), the two read together (merged). `reset()` puts the model back as
    loaded between the two runs. A float32 or float64 checkpoint runs as it is, unlabelled."""
    if subject.dtype_name not in LOW_PRECISION:
        return run(options)
    how, stored = plan(subject, name), subject.dtype_name
    if how == "as stored":
        return _labelled(run(options), {"as_stored": stored})
    with in_float32(subject):
        decided = run(options)
    if how == "float32":
        return _labelled(decided, {"decided_in": "float32", "as_stored": None},
                         f"decided in float32 (the stored {stored} weights held in float32)")
    reset()
    start = time.perf_counter()
    with as_stored_pass(subject):
        again = run(stored_pass_options(name, options))
    return merged(decided, replace(again, seconds=time.perf_counter() - start), stored)


def stored_pass_options(name: str, options: RunOptions) -> RunOptions:
    """The check's options for its stored-dtype pass: its path where half precision computes differently (padding
    masks filled with the dtype's minimum, a cache kept in it) once, on a probe of at most STORED_SEQ_LEN tokens.
    A setting the user gave is kept."""
    given = options.for_check(name)
    narrowed = {key: value for key, value in STORED_PASS[name].items() if key not in given}
    seq_len = min(options.seq_len or STORED_SEQ_LEN, STORED_SEQ_LEN)
    return replace(options, seq_len=seq_len, check_options={**options.check_options, name: {**given, **narrowed}})


@contextlib.contextmanager
def in_float32(subject: Subject) -> Iterator[None]:
    """The subject computes in float32 with exactly its stored weights; its dtype says so while inside."""
    stored = subject.dtype
    with retyped(subject.model, stored, torch.float32):
        subject.dtype = torch.float32
        try:
            yield
        finally:
            subject.dtype = stored
    release_freed_memory()


@contextlib.contextmanager
def as_stored_pass(subject: Subject) -> Iterator[None]:
    subject.as_stored_pass = True
    try:
        yield
    finally:
        subject.as_stored_pass = False


def merged(decided: CheckResult, stored_run: CheckResult, stored: str) -> CheckResult:
    """The float32 verdict, and what the stored dtype adds: a FAIL where a path stands AS_RUN_RATIO floors or more
    above its floor as stored (or turns non-finite there only) while float32 did not fail it."""
    ratio = stored_run.metrics.get("ratio")
    pass_info = {"status": stored_run.status.value, "summary": stored_run.summary, "ratio": ratio,
                 "error": stored_run.metrics.get("error", stored_run.metrics.get("leak")),
                 "noise_floor": stored_run.metrics.get("noise_floor"), "seconds": round(stored_run.seconds, 3)}
    details = {**decided.details, "dtypes": {"decided_in": "float32", "as_stored": stored, "stored_pass": pass_info}}
    metrics = {**decided.metrics, f"{stored}_ratio": ratio} if isinstance(ratio, float) else dict(decided.metrics)
    if stored_run.status is Status.ERROR:  # posdiag could not run the stored-dtype pass: no verdict stands whole
        return replace(stored_run, details=details, metrics=metrics,
                       summary=f"{stored_run.summary} (in the {stored} pass; in float32: "
                               f"{decided.status.value.upper()} {decided.summary})")
    if stored_run.status in (Status.SKIP, Status.NA) or not isinstance(ratio, (int, float)):
        clause = f"its paths as stored in {stored}: not judged ({stored_run.status.value}: {stored_run.summary})"
        return replace(decided, summary=f"{decided.summary}; decided in float32 ({clause})", details=details,
                       metrics=metrics)
    non_finite = ratio != ratio
    if decided.status is not Status.FAIL and (non_finite or ratio >= AS_RUN_RATIO):
        why = "non-finite outputs" if non_finite else (f"{ratio:.3g}x its noise floor, beyond what rounding reaches "
                                                       f"(at least {AS_RUN_RATIO:g}x)")
        return replace(decided, status=Status.FAIL, details=details, metrics=metrics,
                       summary=f"a bug in {stored} only: as stored, {why}: {stored_run.summary} (in float32 with the "
                               f"same weights: {_figure(decided)})")
    clause = f"as stored in {stored}, once on a short probe: worst {ratio:.3g}x its floor" + (
        "" if decided.status is Status.FAIL else ", within rounding")
    return replace(decided, summary=f"{decided.summary}; decided in float32 ({clause})", details=details,
                   metrics=metrics)


def _figure(result: CheckResult) -> str:
    ratio = result.metrics.get("ratio")
    return result.status.value.upper() + (f", worst {ratio:.3g}x its floor" if isinstance(ratio, float) else "")


def _labelled(result: CheckResult, dtypes: dict, clause: str = "") -> CheckResult:
    """Every result of a half-precision checkpoint says the dtype that decided it."""
    summary = f"{result.summary}; {clause}" if clause else result.summary
    return replace(result, summary=summary, details={**result.details, "dtypes": dtypes})
