"""Memory planned before a probe runs: a config value that asks for a huge probe (a 32768-token sliding window on a
tiny model: the cache and generate probes past it would hold [T, T] score matrices of ~50 GB) is planned against the
free memory and named as not run, never allocated until the OS kills the process or the allocator fails (before:
`cache` ERROR on a failed 1 GB allocation, `generate` a false FAIL "crashed" on a 4.3 GB one, under a 4 GB cap)."""

import json
import subprocess
import sys

import torch

from posdiag.model import memory
from posdiag.model.loading import from_module
from posdiag.testing import zoo

CHILD = r"""
import json, resource, sys
cap = 4 << 30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from posdiag import api
from posdiag.model.loading import from_module
from posdiag.model.memory import free_memory
from posdiag.testing import zoo
out = {"free": free_memory("cpu")}
for family, extra in (("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
                      ("gemma2", {})):
    model = zoo.tiny_model(family, sliding_window=32768, max_position_embeddings=131072, **extra)
    report = api.run_checks(from_module(model), None)
    out[family] = {c.name: [c.status.value, c.summary] for c in report.checks}
# Every other length a check derives from the config: a YaRN block's original context (64k) and a 256k context
# (shift, rope, state's long input past every boundary), a 64k learned table (table, fit's material).
for family, extra in (("llama", {"max_position_embeddings": 262144, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536, "rope_theta": 10000.0}}),
        ("gpt2", {"n_positions": 65536})):
    report = api.run_checks(from_module(zoo.tiny_model(family, **extra)), None)
    out["long " + family] = {c.name: [c.status.value, c.summary] for c in report.checks}
print("RESULT " + json.dumps(out))
"""


def test_huge_declared_lengths_give_a_verdict_for_every_check_under_a_4gb_cap():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["free"] < 4 << 30  # the address-space limit counts as the free memory it leaves
    for family in ("mistral", "qwen2", "gemma2"):
        checks = out[family]
        assert not [n for n, (status, _) in checks.items() if status in ("error", "fail")], (family, checks)
        cache, generate = checks["cache"][1], checks["generate"][1]
        assert "sliding window 32768: the probe past it (1 x 32780 tokens)" in cache and "free: not run" in cache, cache
        assert "decoding past the window not judged" in generate and "free: not run" in generate, generate
    for family in ("long llama", "long gpt2"):
        checks = out[family]
        assert not [n for n, (status, _) in checks.items() if status in ("error", "fail")], (family, checks)
    assert "up to position 262143" in out["long llama"]["rope"][1]
    assert out["long gpt2"]["table"][0] == "pass"


def test_the_planned_peak_grows_with_the_square_of_the_length_under_eager_attention():
    subject = from_module(zoo.tiny_model("mistral"))
    small, large = (memory.forward_bytes(subject, 1, n, logits_rows=1) for n in (1024, 4096))
    assert 12 < large / small <= 16
    assert memory.forward_bytes(subject, 1, 64, cache=True) > memory.forward_bytes(subject, 1, 64)
    assert memory.forward_refusal(subject, "a short probe", 1, 64) == ""
    refusal = memory.forward_refusal(subject, "the probe", 1, 1 << 20)
    assert refusal.startswith("the probe (1 x 1048576 tokens) needs ~") and refusal.endswith("free: not run")


def test_free_memory_reads_the_address_space_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (3 << 30, 3 << 30))
    assert memory.free_memory("cpu") < 3 << 30
    assert memory.free_memory(torch.device("cpu")) >= 0


def test_fit_skips_with_the_figures_when_its_material_cannot_be_held(monkeypatch):
    from posdiag import api

    subject = from_module(zoo.tiny_model("llama"))
    monkeypatch.setattr(memory, "free_memory", lambda device: 1 << 20)
    result = api.run_checks(subject, ["fit"]).checks[0]
    assert result.status.value == "skip" and result.summary.startswith("scoring the material (1 x "), result.summary
    assert "free: not run" in result.summary and subject.forward_count == 0
