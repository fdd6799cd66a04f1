"""A child that speaks posdiag's engine protocol (posdiag/ports/engines/child_process.py) and then fails natively,
the ways llama.cpp can: `python crashing_engine.py MODE` with MODE
- "segv": a read of address 0 on the first request (SIGSEGV, as the repacked Q4 kernels of native builds);
- "abort": abort() after a GGML_ASSERT-style line on stderr (SIGABRT);
- "hang": never answers the first request;
- "load-segv": SIGSEGV while "loading", before it answers the open message;
- "healthy": answers every request with zero logits of shape [T, 8] (the twin that must work)."""

import ctypes
import json
import os
import sys
import time

import numpy as np


def main(mode: str) -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdin.readline()
    if mode == "load-segv":
        ctypes.string_at(0)
    answers.write(json.dumps({"ready": {"engine": f"planted {mode}"}}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            return
        if mode == "segv":
            ctypes.string_at(0)
        elif mode == "abort":
            print("GGML_ASSERT(planted) failed", file=sys.stderr, flush=True)
            os.abort()
        elif mode == "hang":
            time.sleep(3600)
        np.save(request["out"], np.zeros((len(request["ids"]), 8), dtype=np.float32))
        answers.write(json.dumps({"shape": [len(request["ids"]), 8]}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main(sys.argv[1])
