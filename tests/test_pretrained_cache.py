"""The posdiag cache stays bounded: a new conversion removes all but the most recently used of the same model, and
a killed conversion's scratch folder once it is stale; other models and other kinds of entry are left alone."""

import os
import time

from posdiag.testing.pretrained import KEEP, SCRATCH_AGE, prune, used


def test_prune_keeps_the_most_recently_used_conversions(tmp_path):
    now = time.time()
    names = [f"smollm2-135m-instruct-{i:016x}" for i in range(KEEP + 2)]
    for age, name in enumerate(names):  # names[0] newest
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
        (tmp_path / f"{name}.lock").touch()
        os.utime(tmp_path / name, (now - 100 * age, now - 100 * age))
    used(tmp_path / names[-1])  # the oldest, used just now, is kept
    kquant = tmp_path / f"smollm2-135m-instruct-{0:016x}.Q4_K_M.gguf"  # another kind of entry: its own prune
    other = tmp_path / f"gemma-3-270m-{0:016x}"
    scratch, fresh_scratch = tmp_path / f"{names[1]}.abc123", tmp_path / f"{names[2]}.def456"
    for path in (other, scratch, fresh_scratch):
        path.mkdir()
    kquant.touch()
    os.utime(scratch, (now - 2 * SCRATCH_AGE, now - 2 * SCRATCH_AGE))
    removed = prune(tmp_path, "smollm2-135m-instruct-")
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name in names)
    assert kept == sorted([names[0], names[-1]]) and len(kept) == KEEP
    assert {p.name for p in removed} == {names[1], names[2], scratch.name}
    assert not (tmp_path / f"{names[1]}.lock").exists() and (tmp_path / f"{names[0]}.lock").exists()
    assert other.is_dir() and kquant.is_file() and fresh_scratch.is_dir()
