"""The Python API: run checks on a Subject and get a typed Report. No printing here."""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from posdiag import checks
from posdiag.errors import InternalsChanged, MaskRefused, PosdiagError, describe_error
from posdiag.options import RunOptions
from posdiag.results import GATEABLE, CheckResult, GatePolicy, Report, Status


def select_checks(only: Iterable[str] | None = None, skip: Iterable[str] | None = None) -> list[str]:
    """Validate --only/--skip against the contract's names; unknown names are usage errors."""
    known = set(checks.ORDER)
    chosen = list(only) if only else checks.available()
    for name in list(chosen) + list(skip or ()):
        if name not in known:
            raise PosdiagError(f"unknown check '{name}'; known checks: {', '.join(checks.available())}")
    skip_set = set(skip or ())
    return [n for n in chosen if n not in skip_set]


def gate_policy(fail_on: str | Iterable[str] | None = None, require: str | Iterable[str] | None = None, *,
                also: tuple[str, ...] = ()) -> GatePolicy:
    """The gate policy from names, as typed (`"warn,skip"`) or listed; unknown names are usage errors.

    fail_on: `warn` and/or `skip` (a check that could not decide / did not run also fails the gate);
    require: checks that must PASS (one that does not, or does not run, fails the gate);
    also: names a command adds to the checks (`compare`)."""
    statuses = []
    for value in _names(fail_on):
        if value not in {s.value for s in GATEABLE}:
            raise PosdiagError(f"--fail-on {value}: use warn and/or skip (a FAIL always fails the gate; an internal "
                               "error always exits 3)")
        statuses.append(Status(value))
    required = _names(require)
    for name in required:
        if name not in (*checks.ORDER, "baseline", *also):
            raise PosdiagError(f"--require {name}: unknown check; known checks: {', '.join(checks.available())}")
    return GatePolicy(fail_on=frozenset(statuses), require=tuple(dict.fromkeys(required)))


def _names(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(v).strip().lower() for v in items if str(v).strip()]


def run_checks(subject: Any, names: Iterable[str] | None = None, options: RunOptions | None = None,
               on_progress: Callable[[str], None] | None = None, policy: GatePolicy | None = None,
               on_result: Callable[[CheckResult], None] | None = None) -> Report:
    """Run the named checks (default: all) on one loaded subject; the model is reused across them.
    The report is judged by `policy` (default: only a FAIL fails the gate). `on_progress(name)` is called as a
    check starts, `on_result(result)` as it finishes.

    Every check starts from the model as loaded: every module's buffers and public attributes are snapshotted once
    before the first check and put back before each check and after the last one. A call's state (a dynamic
    rotary's frequencies, mRoPE's `rope_deltas`: after `generate` on a batch of 3, Qwen3-Omni's thinker crashed
    `cache`'s batch-1 decode, "expected size 1 but got size 0") never reaches the next check, and the caller's model
    is left as it was. Nothing is restored inside a check: `state` is where history is the subject."""
    import torch

    from posdiag.model.module_state import restored, snapshot

    options = options or RunOptions()
    policy = policy or GatePolicy()
    names = list(names) if names is not None else checks.available()
    results: list[CheckResult] = []
    # Collecting between checks frees a big model's activations before the next check; on a
    # tiny model it costs more (~1 s in a process holding many objects) than it saves. What exists before the
    # first check (modules, the model) lives through every check: frozen, a collection scans only what a check
    # made (Gemma-3-270M shape: 0.29 s per collection before, 3.5 s of a 51 s `check`).
    large = sum(p.numel() for p in subject.model.parameters()) > 50_000_000
    freeze = large and gc.get_freeze_count() == 0  # a caller's own frozen objects are left as they are
    if freeze:
        gc.collect()
        gc.freeze()
    fresh = snapshot(subject.model)  # the model as loaded: every check starts from it, and the run leaves it so
    try:
        for name in names:
            if on_progress:
                on_progress(name)
            restored(fresh)
            results.append(_run_one(subject, name, options, lambda: restored(fresh)))
            if on_result:
                on_result(results[-1])
            if large:
                gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # release one check's activations before the next
    except KeyboardInterrupt:
        # Ctrl-C: hand back what finished, marked incomplete (exit 130), never a report that looks whole.
        return Report(model=_tested(subject.info, results), checks=tuple(results), versions=versions(),
                      incomplete=True, policy=policy)
    finally:
        restored(fresh)
        if freeze:
            gc.unfreeze()
    return Report(model=_tested(subject.info, results), checks=tuple(results), versions=versions(), policy=policy)


def _tested(info: Any, results: list[CheckResult]) -> Any:
    """The header's `tested`: the multimodal inputs a check ran through the model where one did (positions' images
    and video), else what loading said (the language model, towers not tested)."""
    from dataclasses import replace

    ran = next((r.details["multimodal"]["tested"] for r in results
                if isinstance(r.details.get("multimodal"), dict) and r.details["multimodal"].get("tested")), "")
    return replace(info, tested=ran) if ran else info


def _run_one(subject: Any, name: str, options: RunOptions, reset: Any = None) -> CheckResult:
    if name not in checks.available():
        return CheckResult(name, Status.SKIP, "not implemented in this version of posdiag")
    from posdiag.half_precision import run_planned

    spec = checks.registered(name)  # verified: a module breaking the check contract fails here, naming what
    start, passes = time.perf_counter(), subject.forward_count
    try:
        # a half-precision checkpoint: decided in float32 where that sees more for less (half_precision)
        result = run_planned(subject, name, lambda given: spec.run(subject, given), options, reset or (lambda: None))
    except PosdiagError:
        raise
    except MaskRefused as exc:  # the model takes no form of the pattern a probe needs: nothing to judge
        result = CheckResult(name, Status.SKIP, str(exc), details={"mask_refused": str(exc)})
    except InternalsChanged as exc:  # a hook's transformers internal moved: no verdict, never an ERROR
        result = CheckResult(name, Status.SKIP, str(exc), details={"internals_changed": exc.what})
    except Exception as exc:  # a crash is posdiag's bug: an ERROR (exit 3), never a pass, never a finding
        error = describe_error(exc)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        result = CheckResult(name, Status.ERROR, f"posdiag could not run this check: {error} (an internal "
                             "error, not a finding about the model; please report)",
                             details={"error": error, "exception": type(exc).__name__,
                                      "where": f"{Path(where.filename).name}:{where.lineno} in {where.name}"})
    return _timed(result, time.perf_counter() - start, subject.forward_count - passes)


def _timed(result: CheckResult, seconds: float, passes: int) -> CheckResult:
    from dataclasses import replace

    return replace(result, seconds=seconds, forward_passes=passes)


def versions() -> dict[str, str]:
    import torch
    import transformers

    from posdiag._version import __version__

    return {"posdiag": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def check_model(model: Any, checks: Iterable[str] | None = None, *, skip: Iterable[str] | None = None,
                fail_on: str | Iterable[str] | None = None, require: str | Iterable[str] | None = None,
                options: RunOptions | None = None, name: str | None = None, **load_options: Any) -> Report:
    """Run posdiag on an in-memory `nn.Module`, a checkpoint directory or a hub id.

    checks: names to run (default: every applicable check); skip: names to leave out.
    fail_on, require: the gate policy, as `--fail-on` / `--require` take it (`report.exit_code` follows it).
    load_options: fields of `posdiag.model.subject.LoadOptions` (dtype, device, upcast, max_batch...).
    Nothing is printed; the returned Report is data (`report.exit_code`, `report.check(name)`).
    """
    from posdiag.model.loading import from_module, load_subject
    from posdiag.options import LoadOptions

    policy = gate_policy(fail_on, require)  # a bad name fails before anything is loaded
    load = LoadOptions(**load_options)
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        subject = load_subject(str(model), load)
    else:
        subject = from_module(model, name=name or type(model).__name__, options=load)
    return run_checks(subject, select_checks(checks, skip), options, policy=policy)
