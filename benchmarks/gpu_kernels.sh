#!/usr/bin/env bash
# Kernel comparison on CUDA (bf16/fp16, lengths up to 32k) in a few minutes: the `kernels` check on
# tiny zoo models (eager vs sdpa vs flash_attention_2/3 where installed) and the synthetic sweep
# (SDPA flash/efficient/cuDNN/math, posdiag naive and tiled, against a float64 reference).
# Results: $OUT/gpu_kernels.{txt,json} (or benchmarks/out/). Without CUDA: a short CPU smoke test.
# Knobs: POSDIAG_MAX_LEN (default 32768), POSDIAG_SYNTH_BUDGET_S (default 150 s for the synthetic part).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-$PWD/benchmarks/out}"; export OUT; mkdir -p "$OUT"
python - <<'PY' 2>&1 | tee -a "$OUT/environment.txt"
import importlib.util, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())
for m in ("flash_attn", "flash_attn_interface"):
    print(m, "installed" if importlib.util.find_spec(m) else "not installed")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PY
timeout "${POSDIAG_TIMEOUT_S:-540}" python benchmarks/gpu_kernels.py
rc=$?
if [ $rc -eq 124 ]; then echo "gpu_kernels: stopped at the time limit; partial results in $OUT" | tee -a "$OUT/gpu_kernels.txt"; fi
exit $rc
