"""A GGUF file read in the parent process, before llama.cpp or transformers touch it.

llama.cpp trusts a file's header: a truncated file, random bytes or tensor shapes that contradict the
metadata can end the process with a segmentation fault instead of an error. So every .gguf posdiag is
given is read here first with the `gguf` package (pure Python, memory-mapped): the header and every
tensor record must parse, every tensor's data must lie inside the file, and the shapes of the tensors a
decoder cannot do without must agree with the metadata that sizes llama.cpp's graph. Anything else is
one PosdiagError line (exit 2).

The file is parsed once: `parsed_once` hands that reader to every GGUFReader transformers opens on the same file
(its config, the model's config, its tensors and its tokenizer each parse it again otherwise: 3.4 s a parse for
SmolLM2-135M's 49k-token vocabulary), and builds gguf's tensor-name map once per architecture (transformers builds
it again for every submodule: 397 times, 7 s). Loading that file with its tokenizer: 31 s -> 10 s.

The same reader rewrites files (`rewrite`): metadata changed or dropped, tensors transformed, or every
tensor dequantised to F32 (`gguf.quants.dequantize`, which reads K-quants too) with the metadata kept:
the F32 twin of a quantised file, which separates what quantisation adds from position handling.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from posdiag.errors import PosdiagError

FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass
class GGUFFile:
    """What posdiag needs of a validated file: scalar metadata, tensor types, the file type."""

    path: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    """ggml storage type by tensor name."""
    reader: Any = field(default=None, repr=False, compare=False)
    """The parsed file (gguf.GGUFReader), for whatever reads it next (parsed_once, rewrite)."""

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def key(self, name: str) -> Any:
        return self.metadata.get(f"{self.arch}.{name}")

    @property
    def type_counts(self) -> dict[str, int]:
        return dict(Counter(self.tensor_types.values()))

    @property
    def quantised_types(self) -> list[str]:
        return sorted(t for t in set(self.tensor_types.values()) if t not in FLOAT_TYPES)

    @property
    def file_type(self) -> str:
        """`Q4_1` from general.file_type (MOSTLY_Q4_1), else the commonest tensor type."""
        value = self.metadata.get("general.file_type")
        if isinstance(value, int):
            try:
                import gguf

                return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        counts = self.type_counts
        return max(counts, key=counts.get) if counts else "?"


def open_reader(path: str):
    """gguf.GGUFReader on PATH; PosdiagError (one line) when the file cannot be parsed."""
    if not os.path.isfile(path):
        raise PosdiagError(f"'{path}' is not a file (a .gguf model is a GGUF file)")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise PosdiagError("reading a .gguf file needs the gguf package: pip install gguf") from None
    try:
        return _plain_views(GGUFReader)(path)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise PosdiagError(f"'{path}' is not a readable GGUF file (truncated or corrupted?): {type(exc).__name__}: "
                           f"{(text[0] if text else '')[:120]}") from None


@functools.cache
def _plain_views(base: type) -> type:
    """BASE (gguf.GGUFReader, or whatever stands in its name) slicing its metadata from a plain ndarray view of
    the memory map rather than the np.memmap itself: the same bytes, still mapped and read-only, without numpy's
    memmap bookkeeping on each of the ~500k slices a 49k-token vocabulary makes (SmolLM2's file: 2.2 s -> 0.7 s a
    parse), and reading each array in one pass (0.7 s -> 0.1 s). `self.data` stays the memmap (its filename is read).
    tests/test_gguf_files.py holds it field for field and tensor for tensor to the library's own reader, so a gguf
    release that changes `_get` or `_get_field_parts` fails there."""

    class Reader(base):
        def _plain_map(self) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            return plain

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            dtype, count = np.dtype(dtype), int(count)
            values = self._plain_map()[offset: offset + dtype.itemsize * count].view(dtype)[:count]
            return values.view(values.dtype.newbyteorder(override_order or self.byte_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            """An array of strings or scalars in one pass: the same parts, indices and types as the library's
            element-by-element recursion, which is most of a parse (SmolLM2's file: 0.7 s -> 0.1 s)."""
            from gguf import GGUFValueType

            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            item, n, offs = GGUFValueType(int(raw_itype[0])), int(count[0]), orig_offs + 12
            if item == GGUFValueType.STRING:
                parts, end = self._strings(offs, n)
            elif item in self.gguf_scalar_to_np:
                values = self._get(offs, self.gguf_scalar_to_np[item], n)
                parts, end = list(values.reshape(n, 1)), offs + int(values.nbytes)
            else:  # arrays of arrays: the library's way
                return super()._get_field_parts(orig_offs, raw_type)
            step = 2 if item == GGUFValueType.STRING else 1  # a string is two parts: its length, then its bytes
            data = list(range(2 + step - 1, 2 + step * n, step))  # each item's value, after the type and the count
            return end - orig_offs, [raw_itype, count, *parts], data, [GGUFValueType.ARRAY] + ([item] if n else [])

        def _strings(self, offs: int, n: int) -> tuple[list[np.ndarray], int]:
            """N strings from OFFS: each a length (uint64, one element) and its bytes, as views; and where they end.
            The lengths are read from eight uint64 views of the map, one per byte alignment."""
            plain = self._plain_map()
            lengths = self.__dict__.get("_lengths")
            if lengths is None:
                wide = np.dtype(np.uint64).newbyteorder(self.byte_order)
                lengths = self._lengths = [plain[k: k + (plain.size - k) // 8 * 8].view(wide) for k in range(8)]
            parts: list[np.ndarray] = []
            for _ in range(n):
                length = lengths[offs & 7][offs >> 3: (offs >> 3) + 1]
                size = int(length[0])
                parts += (length, plain[offs + 8: offs + 8 + size])
                offs += 8 + size
            return parts, offs

    Reader.__name__ = Reader.__qualname__ = base.__name__
    return Reader


@contextlib.contextmanager
def parsed_once(reader: Any) -> Iterator[None]:
    """Inside the block, a gguf.GGUFReader opened for reading on READER's file is READER itself, and
    gguf.get_tensor_name_map answers each (architecture, blocks) from one map (transformers imports both where it
    calls them, so the package's names are what it meets); every other file opens as before. Both are read, never
    written: the reader's fields and tensors are memory-mapped views, the map a dict looked up."""
    import gguf

    original, same = gguf.GGUFReader, os.path.realpath(str(reader.data.filename))
    name_map = gguf.get_tensor_name_map

    class Shared(original):  # isinstance and class attributes stay the library's
        def __new__(cls, path: Any, mode: str = "r") -> Any:
            if mode == "r" and os.path.realpath(str(path)) == same:
                return reader
            return original(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = Shared, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, name_map


_parsed_in_scope: dict[tuple, GGUFFile] | None = None


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Inside the block, inspect_file answers a file it has read from that reading (the same path, inode, size and
    modification time): one command names a file several times (`compare model.gguf http://...`: its tensor types
    for --served-dtype, checked before anything loads, then the reference and the server's floor; four parses, 0.1 s
    each for SmolLM2). Outside, nothing is kept: a parsed vocabulary holds ~70 MB that `check` has no use for."""
    global _parsed_in_scope
    outer = _parsed_in_scope
    _parsed_in_scope = {} if outer is None else outer
    try:
        yield
    finally:
        _parsed_in_scope = outer


def inspect_file(path: str) -> GGUFFile:
    """Read and validate PATH (see the module docstring); PosdiagError naming the first problem."""
    key = _identity(path)
    if key is not None and _parsed_in_scope is not None and key in _parsed_in_scope:
        return _parsed_in_scope[key]
    info = _inspected(path)
    if key is not None and _parsed_in_scope is not None:
        _parsed_in_scope[key] = info
    return info


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _inspected(path: str) -> GGUFFile:
    reader = open_reader(path)
    size = os.path.getsize(path)
    info = GGUFFile(path=path, reader=reader)
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        try:
            value = fld.contents()
        except Exception:
            continue
        if isinstance(value, (int, float, str, bool)):
            info.metadata[name] = value
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        info.metadata["tokenizer.ggml.token_count"] = len(tokens.data)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise PosdiagError(f"'{path}' is truncated: tensor {t.name} ends at byte {end}, the file has {size}")
        info.tensor_types[t.name] = t.tensor_type.name
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    problem = contradiction(info, shapes)
    if problem:
        raise PosdiagError(f"'{path}': {problem} (a broken conversion; llama.cpp could crash on it)")
    return info


def contradiction(info: GGUFFile, shapes: dict[str, list[int]]) -> str | None:
    """The first tensor shape (ggml order: ne0 = the input dimension) that contradicts the metadata."""
    if "general.architecture" not in info.metadata:
        return "no general.architecture key"
    if not shapes:
        return "no tensors"
    width, heads = info.key("embedding_length"), info.key("attention.head_count")
    kv_heads = info.key("attention.head_count_kv") or heads
    head_dim = info.key("attention.key_length") or (width // heads if width and heads else None)
    vocab = info.key("vocab_size") or info.metadata.get("tokenizer.ggml.token_count")
    embd = shapes.get("token_embd.weight")
    if embd is not None and width and embd[0] != width:
        return f"token_embd.weight has rows of {embd[0]}, {info.arch}.embedding_length says {width}"
    if embd is not None and vocab and len(embd) > 1 and embd[1] != vocab:
        return f"token_embd.weight has {embd[1]} rows, the vocabulary has {vocab}"
    blocks = {int(m.group(1)) for n in shapes if (m := re.match(r"blk\.(\d+)\.", n))}
    count = info.key("block_count")
    if count is not None and blocks and max(blocks) + 1 != count:
        return f"tensors for {max(blocks) + 1} blocks, {info.arch}.block_count says {count}"
    rotary = info.key("rope.dimension_count")
    if rotary and head_dim and rotary > head_dim:
        return f"{info.arch}.rope.dimension_count {rotary} exceeds the head size {head_dim}"
    for name, n in (("attn_q", heads), ("attn_k", kv_heads)):
        shape = shapes.get(f"blk.0.{name}.weight")
        if shape is not None and n and head_dim and len(shape) > 1 and shape[1] != n * head_dim:
            return f"blk.0.{name}.weight has {shape[1]} rows, {n} heads x {head_dim} need {n * head_dim}"
        if shape is not None and width and shape[0] != width:
            return f"blk.0.{name}.weight takes inputs of {shape[0]}, the embedding is {width} wide"
    return None


def rewrite(src: str, dst: str | Path, *, keys: dict[str, Any] | None = None,
            tensors: Callable[[str, np.ndarray], np.ndarray] | None = None, dequantise: bool = False,
            reader: Any = None, arrays: dict[str, np.ndarray] | None = None) -> Path:
    """Copy SRC to DST with metadata KEYS set (a value of None drops the key; a new key takes the type
    its Python value suggests), TENSORS(name, array) applied to every tensor, and with DEQUANTISE every
    tensor written as F32 (the F32 twin). Without DEQUANTISE, TENSORS sees and returns the stored data
    (quantised tensors as their raw blocks, one row of bytes per row: row permutations stay exact).
    READER: SRC already open (parsing a file with a 49k-token vocabulary takes seconds); ARRAYS: its tensors
    already dequantised (`dequantised(reader)`), for DEQUANTISE."""
    import gguf

    reader = reader or open_reader(src)
    keys = dict(keys or {})
    arch = str(keys.pop("general.architecture", None) or reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in keys:
            value = keys.pop(name)
            if value is not None:
                writer.add_key_value(name, value, fld.types[0], sub_type=fld.types[-1] if len(fld.types) > 1 else None)
            continue
        if dequantise and name == "general.file_type":
            writer.add_key_value(name, int(gguf.LlamaFileType.ALL_F32), fld.types[0])
            continue
        sub = fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fld.contents(), fld.types[0], sub_type=sub)
    for name, value in keys.items():
        if value is not None:
            writer.add_key_value(name, value, _value_type(gguf, value))
    for t in reader.tensors:
        if dequantise:
            data = arrays[t.name] if arrays is not None else _float32(t)
            writer.add_tensor(t.name, tensors(t.name, data) if tensors else data)
        else:
            data = np.asarray(t.data)
            raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
            writer.add_tensor(t.name, tensors(t.name, data) if tensors else data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def dequantised(reader: Any) -> dict[str, np.ndarray]:
    """Every tensor of an open file as float32, in its stored (GGUF) layout."""
    return {t.name: _float32(t) for t in reader.tensors}


def _float32(tensor: Any) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def _value_type(gguf, value: Any):
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32
