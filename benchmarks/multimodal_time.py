"""Time of a multimodal `check` on a tiny vision-language model against the text-only check of the same model.

The multimodal run builds the model with its image and video placeholder ids inside the vocabulary, so `positions`,
`cache` and `generate` run their image-and-video probes (posdiag.model.multimodal_inputs); the text-only run builds
the same model with those ids outside it (the probes say "not probed"). Every check runs on each, one after the other,
best of `--repeat` runs. The target: the multimodal check within 2x the text-only one.

    OMP_NUM_THREADS=1 python benchmarks/multimodal_time.py --types qwen2_vl qwen2_5_vl qwen3_vl
"""

from __future__ import annotations

import argparse
import time
import warnings


def _timed(model_type: str, in_vocab: bool, repeat: int) -> tuple[float, int, dict[str, float]]:
    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.options import RunOptions
    from posdiag.testing.multimodal import tiny_multimodal

    best, passes, per_check = float("inf"), 0, {}
    for _ in range(repeat):
        subject = from_module(tiny_multimodal(model_type, image_tokens_in_vocab=in_vocab), name=model_type)
        start = time.perf_counter()
        report = run_checks(subject, None, RunOptions(seq_len=16))
        seconds = time.perf_counter() - start
        if seconds < best:
            best, passes = seconds, sum(c.forward_passes for c in report.checks)
            per_check = {c.name: c.seconds for c in report.checks}
    return best, passes, per_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'model type':<12} {'text-only s':>11} {'multimodal s':>12} {'ratio':>6}  forwards  (slowest checks, mm)")
    for model_type in args.types:
        _timed(model_type, False, 1)  # warm: imports, first-call costs
        text, text_passes, _ = _timed(model_type, False, args.repeat)
        multi, multi_passes, per_check = _timed(model_type, True, args.repeat)
        slowest = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_check.items(), key=lambda kv: -kv[1])[:3])
        print(f"{model_type:<12} {text:>11.2f} {multi:>12.2f} {multi / text:>6.2f}  {text_passes}->{multi_passes}"
              f"  ({slowest})")


if __name__ == "__main__":
    main()
