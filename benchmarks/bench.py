"""posdiag's cost against the bare minimum: from_pretrained + one forward of the same shape.

    python benchmarks/bench.py fixtures/llama-tiny --seq-len 64 [--checks shuffle,load] [--device cpu]
        [--force-arbitration]

Each side runs in its own fresh process, so wall time includes Python + torch + transformers
imports for both, and peak memory is each process's max RSS (plus CUDA peak when on GPU); per
check, RSS is sampled every 2 ms while it runs (the model's own memory included) and the CUDA
peak statistics are reset before it.
Prints a markdown table (paste it into docs/performance.md) and --json writes
the raw numbers. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BARE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
path, seq_len, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
t1 = time.perf_counter()
config = transformers.AutoConfig.from_pretrained(path)
model = auto_class(config, family_for(config)).from_pretrained(path, attn_implementation="eager").to(device).eval()
t2 = time.perf_counter()
ids = torch.randint(4, config.vocab_size, (1, seq_len), device=device)
with torch.inference_mode():
    kw = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
    model(input_ids=ids, **kw)
t3 = time.perf_counter()
cuda = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "forward": t3 - t2, "total": t3 - t0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cuda_mb": cuda / 2**20}))
"""

POSDIAG = r"""
import json, os, resource, sys, threading, time
t0 = time.perf_counter()
from typer.testing import CliRunner
import posdiag.api as api
from posdiag.cli import app

# Peak memory per check: RSS sampled every 2 ms while the check runs (ru_maxrss only ever grows),
# and torch's CUDA peak statistics reset before each check.
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
peaks, current = {}, {"name": None, "peak": 0.0}
def sample():
    while True:
        if current["name"] is not None:
            current["peak"] = max(current["peak"], rss_mb())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
run_one = api._run_one
def measured(subject, name, options):
    import torch
    cuda = torch.cuda.is_available() and subject.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    current.update(name=name, peak=rss_mb())
    try:
        return run_one(subject, name, options)
    finally:
        peaks[name] = {"rss_mb": max(current["peak"], rss_mb()),
                       "cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0}
        current["name"] = None
api._run_one = measured
if os.environ.get("POSDIAG_BENCH_FORCE_ARBITRATION") == "1":
    # --force-arbitration: every comparison is re-run in float64 as if it had disagreed (the worst case of
    # "Decide, don't shrug"), to measure its memory; verdicts are unchanged where the float32 ones passed.
    import posdiag.checks._shared as shared
    shared.needs_arbitration = lambda verdict, floor, dtype: True
args = sys.argv[1:]
result = CliRunner().invoke(app, args)
t1 = time.perf_counter()
print(json.dumps({"total": t1 - t0, "exit_code": result.exit_code, "peaks": peaks,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup(flag: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "posdiag", flag], capture_output=True, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="probe length (default: posdiag's own defaults; the bare forward uses 64)")
    parser.add_argument("--checks", default=None, help="comma-separated (default: every check)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--force-arbitration", action="store_true",
                        help="re-run every comparison in float64 (the arbitration's worst case), to measure its cost")
    a = parser.parse_args()
    if a.force_arbitration:
        os.environ["POSDIAG_BENCH_FORCE_ARBITRATION"] = "1"

    bare = child(BARE, a.model, str(a.seq_len or 64), a.device)
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "r.json")
        args = ["check", a.model, "--device", a.device, "--json", report_path, "-q"]
        if a.seq_len:
            args += ["--seq-len", str(a.seq_len)]
        if a.checks:
            args += ["--only", a.checks]
        run = child(POSDIAG, *args)
        with open(report_path) as f:
            report = json.load(f)

    checks = report["checks"]
    load_and_imports = bare["imports"] + bare["load"]
    cuda = a.device.startswith("cuda")
    def memory(entry: dict) -> str:
        text = f"{entry['rss_mb']:.0f} ({entry['rss_mb'] / bare['rss_mb']:.2f}x)"
        if cuda:
            text += f"; CUDA {entry['cuda_mb']:.0f} ({entry['cuda_mb'] / max(bare['cuda_mb'], 1e-9):.2f}x)"
        return text

    rows = [("bare load + 1 forward", f"{bare['total']:.2f}", "1", memory(bare), "1.00")]
    for c in checks:
        # Each check against (load + the forwards it needed, at the bare forward's cost).
        minimum = load_and_imports + max(1, c["forward_passes"]) * bare["forward"]
        peak = run["peaks"].get(c["name"])
        rows.append((f"check `{c['name']}` ({c['status']})", f"{c['seconds']:.2f}", str(c["forward_passes"]),
                     memory(peak) if peak else "", f"{(load_and_imports + c['seconds']) / minimum:.2f}"))
    floor = load_and_imports + len(checks) * bare["forward"]
    whole = {"rss_mb": run["rss_mb"], "cuda_mb": max((p["cuda_mb"] for p in run["peaks"].values()), default=0.0)}
    rows.append((f"posdiag check, whole run ({len(checks)} checks)", f"{run['total']:.2f}",
                 str(sum(c["forward_passes"] for c in checks)), memory(whole), f"{run['total'] / floor:.2f}"))
    print(f"model {a.model}, seq-len {a.seq_len or 'default (64; causal sweeps 32)'}, device {a.device}; imports "
          f"{bare['imports']:.2f}s, load {bare['load']:.2f}s, one forward {bare['forward'] * 1000:.1f}ms")
    print(f"startup: posdiag --help {startup('--help'):.2f}s, posdiag --version {startup('--version'):.2f}s")
    print(f"peak memory ratio (posdiag / bare): {run['rss_mb'] / bare['rss_mb']:.2f}\n")
    print("| what | wall s | forwards | peak memory MB (x bare) | time ratio to minimum |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bare": bare, "posdiag": run, "checks": checks}, f, indent=2)


if __name__ == "__main__":
    main()
