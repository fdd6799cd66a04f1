#!/usr/bin/env bash
# The GPU figures in one run (~6 minutes of wall time on one H200), through ../shared/gpu/run.sh:
#   device run: command "bash .gpu/run.sh bash benchmarks/gpu_run.sh", carry [".gpu", ".whl"]
# Steps (each with its own time limit, JSON and log under $OUT, wall time printed):
#   1. posdiag kernels models:llama1b, bf16, 4096 tokens: every SDPA backend pinned (flash, efficient, cuDNN, math),
#      each against eager and the float64 reference (flex_attention, in the default set on CUDA, compiles in a
#      child process first: left out here to fit the time)
#   2. benchmarks/gpu_kernels.sh trimmed (POSDIAG_MAX_LEN 8192, 40 s synthetic budget)
#   3. posdiag check models:llama1b --device cuda (default: generate() without torch.compile)
#   4. posdiag check models:llama1b --only generate --compile (the compiled path, on purpose)
#   5. posdiag check models:llama8b --no-upcast --dtype bfloat16 (the whole check in bf16; shift: the float64
#      re-run's angles)
#   6. posdiag check models:llama8b --device cuda (the whole check, float32 upcast)
# The factories (models:llama1b, models:llama8b) come from .gpu/models.py (on PYTHONPATH through run.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/out}"; export OUT; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
summary="$OUT/gpu_run.txt"
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$summary"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: exit $rc, $((SECONDS - t0)) s wall$([ $rc -eq 124 ] && echo ' (stopped at its time limit)')" \
    | tee -a "$summary"
}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" | tee -a "$summary"
step kernels_llama1b 80 python3 -m posdiag kernels models:llama1b --device cuda --dtype bfloat16 --seq-len 4096 \
  --impl "sdpa[flash],sdpa[efficient],sdpa[cudnn],sdpa[math]" --json "$OUT/kernels_llama1b.json"
step gpu_kernels 60 env POSDIAG_MAX_LEN=8192 POSDIAG_SYNTH_BUDGET_S=40 POSDIAG_TIMEOUT_S=55 bash benchmarks/gpu_kernels.sh
step check_llama1b 90 python3 -m posdiag check models:llama1b --device cuda --json "$OUT/check_llama1b.json"
step generate_compiled_llama1b 100 python3 -m posdiag check models:llama1b --device cuda --only generate --compile \
  --json "$OUT/generate_compiled_llama1b.json"
step check_llama8b_bf16 90 python3 -m posdiag check models:llama8b --device cuda --no-upcast --dtype bfloat16 \
  --json "$OUT/check_llama8b_bf16.json"
step check_llama8b 75 python3 -m posdiag check models:llama8b --device cuda --json "$OUT/check_llama8b.json"
echo "all steps done; summary in $summary"
