"""GPU kernel comparison for `benchmarks/gpu_kernels.sh` (model mode + synthetic sweep).

Writes JSON + text summaries under $OUT (or benchmarks/out). Everything degrades: without CUDA it
runs a short CPU smoke test; a backend or implementation that refuses is recorded with its reason.
No network: models are the posdiag.testing.zoo families built from configs (default init), widened context.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT") or Path(__file__).parent / "out")
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "gpu_kernels.txt", "a")  # noqa: SIM115 - the log stays open for the whole script, flushed per line


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def synthetic_part(device: str, dtypes: list[str], max_len: int, budget_s: float) -> list[dict]:
    from posdiag.tools.synthetic import Shape, judge_synthetic, sweep_lengths, synthetic

    records = []
    start = time.time()
    configs = [  # (name, heads, kv_heads, head_dim, causal, window, padding)
        ("causal gqa", 16, 4, 128, True, None, 0),
        ("causal padded", 16, 16, 64, True, None, 1),  # padding scaled with T below
        ("sliding window 4096", 16, 4, 128, True, 4096, 0),
    ]
    for dtype in dtypes:
        for name, h, kv, d, causal, window, pad in configs:
            for t in sweep_lengths(1024, max_len):
                if time.time() - start > budget_s:
                    say(f"  synthetic: time budget reached, stopping at {name} {dtype} T={t}")
                    return records
                shape = Shape(batch=1, heads=h, kv_heads=kv, q_len=t, k_len=t, head_dim=d, causal=causal,
                              alignment="bottom_right", padding=(t // 4) if pad else 0, window=window,
                              dtype=dtype, device=device)
                try:
                    res = synthetic(shape, memory=True, repeats=2)
                except Exception as exc:
                    say(f"  {name} {dtype} T={t}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                    torch.cuda.empty_cache() if device == "cuda" else None
                    continue
                verdicts = judge_synthetic(res, dtype)
                for r in res:
                    peak = f"{r.peak_bytes / 2**20:9.1f} MiB" if r.peak_bytes is not None else "        - MiB"
                    say(f"  {name:20s} {dtype:8s} T={t:6d} {r.name:24s} {r.status:11s} err {r.error:.2e} "
                        f"{r.seconds * 1e3:9.2f} ms {peak} {verdicts.get(r.name, ''):10s} {r.empty_rows} {r.note[:70]}")
                records.append({"config": name, "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
                                "results": [dict(r.to_dict(), verdict=verdicts.get(r.name, "")) for r in res]})
                if device == "cuda":
                    torch.cuda.empty_cache()
    return records


def model_part(device: str, dtypes: list[str], seq_lens: list[int], families: list[str]) -> list[dict]:
    import importlib.util

    import transformers

    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.options import LoadOptions, RunOptions
    from posdiag.testing import zoo

    transformers.utils.logging.set_verbosity_error()
    from posdiag.checks.kernels.scenarios import CPU_BACKENDS, SDPA_BACKENDS

    # every SDPA backend pinned and judged on its own (a refused input is listed as not applicable)
    impls = [f"sdpa[{b}]" for b in SDPA_BACKENDS if device == "cuda" or b in CPU_BACKENDS]
    for name, module in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")):
        if importlib.util.find_spec(module) is not None:
            impls.append(name)
        else:
            say(f"  {name}: package {module} not installed, not compared")
    records = []
    for family in families:
        for dtype in dtypes:
            for seq in seq_lens:
                try:
                    kw = {"max_position_embeddings": max(seq_lens)} if family not in ("gpt2",
                                                                                      "gptj", "mpt", "t5") else {}
                    if family in ("gpt2", "gptj"):
                        kw = {"n_positions": max(seq_lens)}
                    model = zoo.tiny_model(family, dtype=getattr(torch, dtype), **kw).to(device)
                    subject = from_module(model, options=LoadOptions(upcast=False))
                    opts = RunOptions(seq_len=seq, check_options={"kernels": {"implementations": impls}})
                    t0 = time.time()
                    result = run_checks(subject, ["kernels"], opts).check("kernels")
                    say(f"  {family:12s} {dtype:8s} T={seq:5d} {result.status.value.upper():5s} "
                        f"{time.time() - t0:6.1f}s {result.summary[:200]}")
                    for impl, info in result.details.get("implementations", {}).items():
                        for sc, s in (info.get("scenarios") or {}).items():
                            say(f"      {impl:18s} {sc:20s} err {s['error']:.2e} eager {s['eager_error']:.2e} "
                                f"ratio {s['ratio']:.3g} worst {s['worst_layer']} pad-rows {s['padding_rows'] or '-'} "
                                f"top1 {s['top1_agreement']} kl {s['kl']}")
                        for sc, why in (info.get("not_applicable") or {}).items():
                            say(f"      {impl:18s} {sc:20s} n/a: {why[:160]}")
                        if info.get("reason"):
                            say(f"      {impl:18s} {info['status']}: {info['reason']}")
                    records.append({"family": family, "dtype": dtype, "seq_len": seq, "result": result.to_dict()})
                    del model, subject
                    if device == "cuda":
                        torch.cuda.empty_cache()
                except Exception as exc:
                    say(f"  {family} {dtype} T={seq}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                    LOG.write(traceback.format_exc())
    return records


def main() -> int:
    cuda = torch.cuda.is_available()
    say(f"== posdiag gpu_kernels  torch {torch.__version__}  cuda {cuda}"
        + (f"  {torch.cuda.get_device_name(0)}" if cuda else ""))
    if cuda:
        device, dtypes = "cuda", ["bfloat16", "float16"]
        max_len = int(os.environ.get("POSDIAG_MAX_LEN", "32768"))
        seq_lens = [512, 4096]
        families = ["llama", "qwen2", "mistral", "gemma3", "gpt2", "falcon_rope", "falcon_alibi", "bert", "t5"]
        budget = float(os.environ.get("POSDIAG_SYNTH_BUDGET_S", "150"))
    else:
        say("no CUDA device: CPU smoke test only (short lengths, float32/bfloat16)")
        device, dtypes, max_len, seq_lens = "cpu", ["float32", "bfloat16"], 2048, [64]
        families, budget = ["llama", "gpt2"], 60.0
    say("-- model mode (kernels check)")
    models = model_part(device, dtypes, seq_lens, families)
    say("-- synthetic (error vs float64 reference, time, peak memory)")
    synth = synthetic_part(device, dtypes, max_len, budget)
    (OUT / "gpu_kernels.json").write_text(json.dumps({"cuda": cuda, "models": models, "synthetic": synth},
                                                      indent=1, default=str))
    say(f"wrote {OUT / 'gpu_kernels.json'} and {OUT / 'gpu_kernels.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
