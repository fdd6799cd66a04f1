"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, its `server` extra) for tests: started
on 127.0.0.1 at a free port and always stopped (bounded waits; killed when it does not stop)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(model: Path, n_ctx: int = 256, extra: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of a server for MODEL: one thread (its prompt batches too: the server's default is every
    core), float32 KV cache (type 0 = GGML_TYPE_F32: llama.cpp's default f16 cache alone moves the logits ~1e-4).
    Its weight repacking is not exposed by this server. EXTRA: more of its options (`--n_batch 16`, `--cache True`)."""
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(n_ctx), "--type_k", "0",
            "--type_v", "0", "--verbose", "False", *extra]
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            wait_ready(base, proc, err)
            yield base, proc
        finally:
            stop(proc)


def wait_ready(base: str, proc: subprocess.Popen, err, timeout: float = START_TIMEOUT, poll: float = 0.2,
               name: str = "the server") -> None:
    """Until the OpenAI-compatible server at `base` lists its models; its stderr tail (`err`) if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err.seek(0)
            raise RuntimeError(f"{name} exited with {proc.returncode}: {err.read()[-600:]!r}")
        try:
            with urllib.request.urlopen(base + "/models", timeout=2) as r:
                json.load(r)
                return
        except OSError:
            time.sleep(poll)
    raise RuntimeError(f"{name} did not answer within {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
