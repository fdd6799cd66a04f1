"""load — did the checkpoint really provide its position parameters?

transformers re-initialises a parameter the checkpoint lacks and only logs a warning, so a
checkpoint missing its position table loads "fine" with a random one (and a random table
still injects positions: `shuffle` passes). We read the safetensors keys ourselves and
compare them with the model's position parameters; loading_info's missing / unexpected /
mismatched keys are cross-checked. Non-persistent buffers (RoPE inv_freq) are recomputed
from the config at load and are never in a checkpoint: not counted.

A checkpoint that ships its own modeling code (config.json's auto_map) but was loaded as transformers'
built-in class (no --trust-remote-code) is at best a WARN naming the class tested: the code it ships
was not what the checks ran.
"""

from __future__ import annotations

from dataclasses import replace

from posdiag.checks import CheckSpec
from posdiag.model.checkpoint import in_checkpoint, is_position_key
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, Table

SPEC = CheckSpec(
    name="load",
    title="Position parameters loaded",
    proves="the checkpoint itself supplies every position parameter the model uses (none re-initialised)",
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    result = position_parameters(subject)
    untested = subject.load_info.untested_code
    if not untested:
        return result
    # The checkpoint's own modeling code was not what the checks ran: never a clean PASS.
    details = {**result.details, "shipped_code": dict(subject.load_info.shipped_code), "shipped_code_tested": False,
               "model_class": type(subject.model).__name__}
    if result.status is Status.FAIL:
        return replace(result, summary=f"{result.summary}; also: {untested}", details=details)
    return replace(result, status=Status.WARN, summary=f"{untested}; {result.summary}", details=details)


def position_parameters(subject: Subject) -> CheckResult:
    """Whether every position parameter of the model came from the checkpoint."""
    info = subject.load_info
    if info.checkpoint_keys is None:
        if info.source != "pickle":  # nothing was loaded: there is no checkpoint to check
            return SPEC.result(Status.NA, "no checkpoint files: the model was built in memory",
                               details={"source": info.source})
        return SPEC.result(Status.SKIP, "pickle checkpoint: keys not read without unpickling",
                           details={"source": info.source})

    keys = set(info.checkpoint_keys)
    model_position = [n for n, _ in subject.model.state_dict().items() if is_position_key(n)]
    # A tied or shared table appears under several names; one provided copy covers the others.
    absent = [n for n in model_position if not in_checkpoint(n, keys)]
    missing_reported = [k for k in info.missing_keys if is_position_key(k)]
    absent = sorted(set(absent) | set(missing_reported))
    provided = sorted(n for n in model_position if n not in absent)
    unexpected = [k for k in info.unexpected_keys if is_position_key(k)]
    mismatched = [k for k in info.mismatched_keys if is_position_key(k)]

    sinusoidal = subject.position_kind == "sinusoidal"
    rows = [(n, "provided") for n in provided] + [(n, "MISSING: re-initialised at load") for n in absent]
    rows += [(n, "unexpected in checkpoint") for n in unexpected] + [(n, "shape mismatch") for n in mismatched]
    table = Table("position parameters", ("parameter", "state"), tuple(rows)) if rows else None
    details = {"provided": provided, "missing": absent, "unexpected": unexpected, "mismatched": mismatched,
               "files": list(info.files), "source": info.source, "position_kind": subject.position_kind}
    metrics = {"provided": len(provided), "missing": len(absent), "unexpected": len(unexpected),
               "mismatched": len(mismatched)}
    tables = (table,) if table else ()

    if mismatched:
        return SPEC.result(Status.FAIL, f"position parameter shape mismatch: {', '.join(mismatched[:3])}",
                           metrics, details, tables)
    if absent and not sinusoidal:
        return SPEC.result(Status.FAIL,
                           f"{len(absent)} position parameter(s) missing from the checkpoint and randomly "
                           f"re-initialised: {', '.join(absent[:3])}", metrics, details, tables)
    if absent and sinusoidal:
        return SPEC.result(Status.WARN,
                           f"sinusoidal table not in the checkpoint, recomputed at init: {', '.join(absent[:3])}",
                           metrics, details, tables)
    if unexpected:
        return SPEC.result(Status.WARN,
                           f"checkpoint has position tensors the model did not use: {', '.join(unexpected[:3])}",
                           metrics, details, tables)
    if not model_position:
        what = {"rope": "RoPE frequencies are recomputed from the config (non-persistent inv_freq)",
                "alibi": "ALiBi slopes are computed, not stored"}.get(subject.position_kind,
                                                                     "no position parameters in this model")
        # Nothing was read, so nothing passed: the check does not apply (computed, not stored, positions).
        return SPEC.result(Status.NA, f"nothing stored to check: {what}", metrics, details, tables)
    return SPEC.result(Status.PASS, f"all {len(provided)} position parameter(s) came from the checkpoint "
                       f"({info.source})", metrics, details, tables)
