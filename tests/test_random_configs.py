"""Healthy random configurations never FAIL: 0 false verdicts over random RoPE decoders.

Each case draws a model type (llama, mistral, qwen2, qwen3, phi3, gemma), 1-3 layers, head_dim 8-128, a GQA
ratio, initializer_range 0.02-0.3, a rope type (default, linear, dynamic, yarn, llama3, longrope) and, where the
family has one, a sliding window, then runs every check. Nothing is planted, so a FAIL (or an internal error) is
a false verdict. Before float64 arbitration, such configs FAILed `cache` and `generate` at 11-18x a floor that
came out bitwise 0.

Measured on the full sweep (200 configurations: llama 37, mistral 37, phi3 40, qwen3 34, qwen2 31, gemma 21; rope
default 70, longrope 36, dynamic 28, llama3 27, yarn 21, linear 18): 0 FAIL, 0 error, at least 7 checks PASS on
each. CI runs a sample (POSDIAG_RANDOM_CONFIGS, default 6, plus the regression seeds); the full sweep:

    POSDIAG_RANDOM_CONFIGS=200 python -m pytest -n 2 -q -m slow tests/test_random_configs.py
"""

from __future__ import annotations

import os
import random

import pytest
from sweep_rows import exhaustive

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

SAMPLE = int(os.environ.get("POSDIAG_RANDOM_CONFIGS", "6"))
FULL = SAMPLE > 6
WINDOWED = {"mistral", "qwen2", "qwen3"}
OPTIONS = RunOptions(seq_len=24, permutations=2, check_options={"cache": {"decode_steps": 4},
                                                                "generate": {"new_tokens": 3}})


def random_config(seed: int) -> tuple[str, dict]:
    """(model_type, config overrides) drawn from `seed`: every field a healthy checkpoint may carry."""
    rng = random.Random(seed)
    model_type = rng.choice(["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"])
    head_dim = rng.choice([8, 16, 32, 64, 128])
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 4])
    context = rng.choice([64, 128, 256])
    config = dict(num_hidden_layers=rng.randint(1, 3), num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, hidden_size=heads * head_dim if model_type == "phi3" else rng.choice([32, 64]),
                  intermediate_size=64, vocab_size=256, max_position_embeddings=context,
                  initializer_range=rng.choice([0.02, 0.05, 0.1, 0.2, 0.3]), tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "phi3":
        config.pop("head_dim")
    # Phi-3's config accepts only its own longrope block (with per-checkpoint factor tables): default there.
    rope_type = "default" if model_type == "phi3" else rng.choice(["default", "linear", "dynamic", "yarn", "llama3",
                                                                   "longrope"])
    theta = rng.choice([1e4, 5e5, 1e6])
    rope: dict = {"rope_type": rope_type, "rope_theta": theta}
    half = (config.get("head_dim") or config["hidden_size"] // heads) // 2
    if rope_type in ("linear", "dynamic"):
        rope["factor"] = rng.choice([2.0, 4.0])
    elif rope_type == "yarn":
        rope.update(factor=rng.choice([2.0, 4.0]), original_max_position_embeddings=context // 2)
    elif rope_type == "llama3":
        rope.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=context // 2)
    elif rope_type == "longrope":
        rope.update(short_factor=[1.0 + rng.random() for _ in range(half)],
                    long_factor=[1.0 + 4 * rng.random() for _ in range(half)],
                    original_max_position_embeddings=context // 2)
    config["rope_parameters"] = rope
    if model_type in WINDOWED and rng.random() < 0.5:
        config.update(sliding_window=rng.choice([4, 8, 16]), use_sliding_window=True)
    return model_type, config


# Configurations that once gave a false verdict, run in every sample: seed 100 (Mistral, llama3 scaling, head_dim
# 64, init 0.2) FAILed generate at 10.4x a floor that came out bitwise 0 until its float64 re-run was guarded
# against padding rows that turn NaN in float64.
REGRESSIONS = [100]
SEEDS = list(range(SAMPLE)) + [s for s in REGRESSIONS if s >= SAMPLE]


# The sample rotates (a seventh of it per run, tests/sweep_rows.py); the regression seeds run every time.
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) for s in SEEDS] if FULL
                         else exhaustive(SEEDS, always=REGRESSIONS))
def test_healthy_random_config_never_fails(seed):
    model_type, config = random_config(seed)
    try:
        model = zoo.tiny_model_of_type(model_type, attn_implementation="eager", **config)
    except (ValueError, TypeError) as exc:  # a combination transformers itself refuses: not a posdiag case
        pytest.skip(f"transformers refuses {model_type} {config}: {exc}")
    report = run_checks(from_module(model), None, OPTIONS)
    wrong = {c.name: c.summary for c in report.checks if c.status in (Status.FAIL, Status.ERROR)}
    assert not wrong, (model_type, config, wrong)
    judged = [c for c in report.checks if c.status is Status.PASS]
    assert len(judged) >= 5, [(c.name, c.status.value, c.summary) for c in report.checks]
