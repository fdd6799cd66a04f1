"""An engine in a child process: a native crash, abort or hang there is one line here, never the end of posdiag.

llama.cpp is C++: a bad file or a CPU-specific kernel (weight repacking on AVX-512/AMX builds, measured
on Q4_1 and Q4_K files) ends its process with SIGSEGV or SIGABRT, which no Python `except` can catch. So
the engine runs in a child; the parent talks to it with one JSON line per request on the child's stdin
and one per answer on its stdout (the child moves its own stdout to stderr first, so library prints
cannot mix with answers). Logits come back through a .npy file in a directory the parent owns (a [T, V]
float32 array is 200 MB at 1024 x 49152: one write and one read, no pipe framing).

The protocol (the child's side is posdiag/ports/engines/llama_child.py):
    parent: {"open": {...}}                        child: {"ready": {settings}} | {"error": "..."}
    parent: {"ids": [...], "split": n|null, "stepped": bool, "out": path}   child: {"shape": [T, V]} | {"error": "..."}
A child that dies is named by its signal (SIGSEGV, SIGABRT...) or exit status, with the last line it
wrote to stderr; one that does not answer within the timeout is killed and named so. Both raise
EngineCrash (exit 3: the engine failed, not the input).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from posdiag.errors import EngineCrash, PosdiagError

DEFAULT_TIMEOUT = float(os.environ.get("POSDIAG_ENGINE_TIMEOUT", "900"))
"""Seconds one request may take (loading a file, one forward) before the child is called hung."""


class EngineProcess:
    """One child running ARGV for FILE; `request` sends one message and waits for its answer."""

    def __init__(self, argv: list[str], file: str, what: str = "llama.cpp", timeout: float = DEFAULT_TIMEOUT):
        self.file, self.what, self.timeout = file, what, timeout
        self.workdir = tempfile.mkdtemp(prefix="posdiag-engine-")
        self.stderr_path = Path(self.workdir) / "stderr.txt"
        self.calls = 0
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_no_core_dump)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.workdir)

    def request(self, message: dict[str, Any], doing: str) -> dict[str, Any]:
        """Send MESSAGE; the child's answer. EngineCrash when it dies or hangs; PosdiagError when it
        answers with an error (a Python exception inside the engine: its message)."""
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died(doing)
        line = self._read_line(doing)
        try:
            answer = json.loads(line)
        except ValueError:
            raise EngineCrash(f"{self.what} answered garbage on '{self.file}' while {doing}: {line[:120]!r}") from None
        if "error" in answer:
            raise PosdiagError(f"{self.what} failed on '{self.file}' while {doing}: {answer['error']}")
        return answer

    def logits(self, ids: list[int], split: int | None = None, stepped: bool = False) -> np.ndarray:
        """[T, V] float32 logits of IDS (prefilled up to SPLIT, then continued in one eval, or one token at a
        time when STEPPED, when SPLIT is given)."""
        self.calls += 1
        out = Path(self.workdir) / f"logits-{self.calls}.npy"
        how = f" continued from position {split}{' token by token' if stepped else ''}" if split is not None else ""
        self.request({"ids": [int(i) for i in ids], "split": split, "stepped": stepped, "out": str(out)},
                     f"running {len(ids)} tokens{how}")
        try:
            return np.load(out)
        finally:
            out.unlink(missing_ok=True)

    def close(self) -> None:
        self._finalizer()

    def _read_line(self, doing: str) -> str:
        deadline = time.monotonic() + self.timeout
        stream = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:  # a hung child reads no quit message: killed at once, not after close's grace period
                self.proc.kill()
                self.proc.wait()
                self.close()
                raise EngineCrash(f"{self.what} did not answer within {self.timeout:g} s on '{self.file}' while "
                                  f"{doing}: stopped (a hang; POSDIAG_ENGINE_TIMEOUT sets the limit)")
            ready, _, _ = select.select([stream], [], [], min(left, 1.0))
            if ready:
                line = stream.readline()
                if not line:
                    self._died(doing)
                return line.decode(errors="replace")
            if self.proc.poll() is not None:
                self._died(doing)

    def _died(self, doing: str):
        code = self.proc.wait()
        if code < 0:
            try:
                how = f"crashed with {signal.Signals(-code).name} (signal {-code})"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        tail = last_line(self.stderr_path)
        self.close()
        raise EngineCrash(f"{self.what} {how} on '{self.file}' while {doing}" + (f" (last words: {tail})" if tail
                                                                                   else ""))


def _no_core_dump() -> None:
    """In the child, before it runs: a crash leaves no core file behind (a 100 MB model maps into every one)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def last_line(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def _stop(proc: subprocess.Popen, workdir: str) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.write(b'{"quit": true}\n')
            proc.stdin.flush()
            proc.wait(timeout=5)
        except Exception:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(Exception):
            stream.close()
    shutil.rmtree(workdir, ignore_errors=True)
