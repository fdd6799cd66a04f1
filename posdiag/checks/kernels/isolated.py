"""Run one attention implementation of the `kernels` check in a separate process.

Some implementations can take the whole process down instead of raising: flex_attention has
crashed the interpreter on CPU (a segfault in a compiled kernel), and it compiles kernels with
the machine's C++ toolchain first. In a child process a crash becomes a finding and posdiag
still writes its report. The child loads the checkpoint again with the same LoadOptions (the
same dtype, device and seeded re-initialisation), runs the scenarios it is handed and writes the
hidden states back; tensors travel through torch.save / torch.load(weights_only=True).

    python -m posdiag.checks.kernels.isolated REQUEST.pt RESULT.pt
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

from posdiag.checks.kernels.running import Outcome, Refused, describe_exception, forward_all, implementation
from posdiag.checks.kernels.scenarios import Run, Scenario
from posdiag.model.subject import Subject

ISOLATED = frozenset({"flex_attention"})  # implementations that run only in a child process
CHILD_COMMAND = (sys.executable, "-m", "posdiag.checks.kernels.isolated")
CHILD_TIMEOUT_S = 1800  # compiling flex kernels on a CPU takes minutes; a hang must still end


def run_isolated(subject: Subject, name: str, scenarios: list[Scenario]) -> Outcome:
    """Run `name` on `scenarios` in a child process that loads subject's checkpoint again."""
    import torch

    if not subject.is_hf or subject.load_info.checkpoint_keys is None:
        return Outcome(kind="unavailable", reason=f"{name} runs in a separate process, which must load the model "
                                                  "from a checkpoint (an in-memory model cannot be re-loaded there)")
    with tempfile.TemporaryDirectory(prefix="posdiag-isolated-") as tmp:
        request, result = os.path.join(tmp, "request.pt"), os.path.join(tmp, "result.pt")
        # The child offloads (if at all) to its own temporary folder, never to the parent's.
        options = dict(dataclasses.asdict(subject.options), offload_folder=None)
        torch.save({"spec": subject.spec, "options": options,
                    "dtype": str(subject.dtype).removeprefix("torch."), "implementation": name,
                    "scenarios": [dataclasses.asdict(sc) for sc in scenarios]}, request)
        try:
            proc = subprocess.run([*CHILD_COMMAND, request, result],
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Outcome(kind="unavailable",
                           reason=f"{name} did not finish within {CHILD_TIMEOUT_S} s in its process")
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
            return Outcome(kind="crashed", reason=f"{name} killed its process ({sig}){_last_line(proc.stderr)}")
        if proc.returncode != 0 or not os.path.exists(result):
            return Outcome(kind="unavailable",
                           reason=f"the {name} process failed (exit {proc.returncode}){_last_line(proc.stderr)}")
        payload = torch.load(result, weights_only=True)
    if "runs" not in payload:
        return Outcome(kind=payload["kind"], reason=payload["reason"])
    subject.forward_count += payload["forward_count"]
    runs = [Run([h.to(subject.device) for h in r["hidden"]],
                None if r["logits"] is None else r["logits"].to(subject.device), list(r["layer_names"]))
            for r in payload["runs"]]
    return Outcome(runs=runs, note=payload["note"])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return f": {lines[-1][:200]}" if lines else ""


def _child(request_path: str, result_path: str) -> None:
    import warnings

    import torch

    from posdiag.model.loading import load_subject
    from posdiag.options import LoadOptions

    warnings.simplefilter("ignore")
    request = torch.load(request_path, weights_only=True)
    name = request["implementation"]
    subject = load_subject(request["spec"], LoadOptions(**request["options"]))
    got = str(subject.dtype).removeprefix("torch.")
    if got != request["dtype"]:
        torch.save({"kind": "unavailable", "reason": f"the {name} process loaded the model in {got}, "
                                                     f"not {request['dtype']}"}, result_path)
        return
    scenarios = [Scenario(**{k: (v.to(subject.device) if isinstance(v, torch.Tensor) else v) for k, v in sc.items()})
                 for sc in request["scenarios"]]
    try:
        with implementation(subject, name) as note:
            runs = forward_all(subject, scenarios)
    except Refused as exc:
        torch.save({"kind": "refused", "reason": str(exc)}, result_path)
        return
    except Exception as exc:
        kind, reason = describe_exception(name, exc)
        torch.save({"kind": kind, "reason": reason}, result_path)
        return
    torch.save({"note": note, "forward_count": subject.forward_count,
                "runs": [{"hidden": [h.cpu() for h in r.hidden], "logits": None if r.logits is None else r.logits.cpu(),
                          "layer_names": r.layer_names} for r in runs]}, result_path)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
