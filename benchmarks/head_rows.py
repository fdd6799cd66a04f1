"""What one LM-head call costs by the number of rows it computes, on this machine's BLAS (float32).

    python benchmarks/head_rows.py [--vocab 262144] [--hidden 640] [--threads 2]

A decode step computes the logits of one row per sequence: its cost is reading the head's weights, and on some CPUs
a product of 2 or 3 rows reads them once per row (measured on a 2-core AMD EPYC: 1 row 60 ms, 3 rows 224 ms, 4 rows
119 ms for the 262k x 640 head of Gemma 3 270M). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    head = torch.randn(a.vocab, a.hidden)
    print(f"head {a.vocab} x {a.hidden} float32, {a.threads} threads")
    for rows in (1, 2, 3, 4, 8, 16, 64):
        x = torch.randn(rows, a.hidden)
        torch.nn.functional.linear(x, head)  # warm-up
        start = time.perf_counter()
        for _ in range(a.repeats):
            torch.nn.functional.linear(x, head)
        print(f"{rows:3d} rows: {(time.perf_counter() - start) / a.repeats * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
