"""An exported graph as a candidate: a `.onnx` file run with ONNX Runtime on the CPU (`pip install onnxruntime onnx`, or
`pip install -e '.[onnx]'` in the clone).

The graph's inputs are read from the graph, not assumed: `input_ids` (or the first integer input), and where the
graph has them `attention_mask` (ones), `position_ids` (0..T-1, or continuing a cache) and past key/values
(`past_key_values.*`/`past.*`: empty at the start, the graph's own `present.*` outputs when a cache is continued).
The logits are the output named `logits` (else the first). It is then an engine like any other
(posdiag/ports/candidates.py) and judged on its logits by position (posdiag/ports/logits/__init__.py):

- a graph traced at one sequence length (its `input_ids` has a fixed sequence dimension) declares that length as
  its context: positions past it are not covered, and the profile says where it ends;
- a graph with past key/values is also run as a prefill of the first half plus a continuation through its own
  cache (`logits_continued`): a graph that ignores the past length (positions restarted at 0) FAILs there.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from posdiag.errors import PosdiagError
from posdiag.ports.engines.logits_only import Engine, engine_threads

PAST_PREFIXES = ("past_key_values", "past")
NUMPY = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
         "tensor(float16)": np.float16, "tensor(double)": np.float64, "tensor(bool)": np.bool_}


def open_port(spec: str, options: Any) -> Engine:
    """The runtime entry (posdiag/ports/candidates.RUNTIMES): a .onnx file in ONNX Runtime."""
    return load_onnx(spec)


def load_onnx(path: str, *, threads: int | None = None) -> Engine:
    if not os.path.isfile(path):
        raise PosdiagError(f"'{path}' does not exist (no such file)")
    try:
        import onnxruntime as ort
    except ImportError:
        raise PosdiagError("a .onnx candidate needs onnxruntime: pip install onnxruntime onnx") from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads or engine_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep, never spin
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = " ".join(str(exc).split())[:200]
        raise PosdiagError(f"ONNX Runtime cannot load '{path}': {type(exc).__name__}: {text}") from None
    runner = OnnxRunner(session, path)
    settings = {"engine": f"ONNX Runtime {ort.__version__} (CPU)", "inputs": ", ".join(runner.described()),
                "threads": options.intra_op_num_threads, "spinning": "off", "dtype": runner.dtype}
    if runner.fixed_length:
        settings["fixed sequence length"] = runner.fixed_length
    return Engine(impl=runner, name=path, settings=settings, context_length=runner.fixed_length)


class OnnxRunner:
    """The protocol object over one session: logits(ids), and logits_continued(ids, split) when the graph takes
    past key/values."""

    def __init__(self, session: Any, path: str):
        self.session, self.path = session, path
        inputs = {i.name: i for i in session.get_inputs()}
        ints = [n for n, i in inputs.items() if i.type in ("tensor(int64)", "tensor(int32)")]
        self.ids_name = "input_ids" if "input_ids" in inputs else (ints[0] if ints else None)
        if self.ids_name is None:
            raise PosdiagError(f"'{path}' has no integer input for token ids (inputs: {', '.join(inputs)})")
        self.inputs = inputs
        self.past = [n for n in inputs if n.startswith(PAST_PREFIXES)]
        outputs = [o.name for o in session.get_outputs()]
        self.logits_name = "logits" if "logits" in outputs else outputs[0]
        self.presents = _presents(self.past, [o for o in outputs if o != self.logits_name])
        known = {self.ids_name, "attention_mask", "position_ids", *self.past}
        unknown = [n for n in inputs if n not in known]
        if unknown:
            raise PosdiagError(f"'{path}' takes inputs posdiag does not know how to fill: {', '.join(unknown)}")
        seq = inputs[self.ids_name].shape[-1] if inputs[self.ids_name].shape else None
        self.fixed_length = seq if isinstance(seq, int) and seq > 0 else None
        self.dtype = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}.get(
            inputs[self.past[0]].type, "as exported") if self.past else "as exported"
        if self.past:
            self.logits_continued = self._continued

    def described(self) -> list[str]:
        names = [self.ids_name] + [n for n in ("attention_mask", "position_ids") if n in self.inputs]
        if self.past:
            names.append(f"{len(self.past)} past key/values")
        return names

    def logits(self, ids: list[int]) -> np.ndarray:
        return self._run(ids, 0, None)[0]

    def _continued(self, ids: list[int], split: int) -> np.ndarray:
        first, cache = self._run(ids[:split], 0, None)
        rest, _ = self._run(ids[split:], split, cache)
        return np.concatenate([first, rest])

    def _run(self, ids: list[int], start: int, cache: dict[str, np.ndarray] | None):
        n = len(ids)
        if self.fixed_length and n != self.fixed_length:
            shape = self.inputs[self.ids_name].shape
            raise PosdiagError(f"'{self.path}' was exported at a fixed sequence length of {self.fixed_length} (input "
                               f"'{self.ids_name}' has shape {shape}): it cannot run {n} tokens; export it with a "
                               "dynamic sequence axis")
        feeds: dict[str, np.ndarray] = {self.ids_name: np.asarray([ids], dtype=self._np(self.ids_name))}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, start + n), dtype=self._np("attention_mask"))
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(start, start + n, dtype=self._np("position_ids"))[None]
        for name in self.past:
            feeds[name] = cache[name] if cache else self._empty(name)
        out = dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, feeds), strict=True))
        logits = out[self.logits_name]
        logits = logits[0] if logits.ndim == 3 else logits
        return logits, {p: out[o] for p, o in self.presents.items()}

    def _np(self, name: str):
        return NUMPY.get(self.inputs[name].type, np.int64)

    def _empty(self, name: str) -> np.ndarray:
        """A past of length 0: the graph's own shape, its symbolic dims 1 (batch) except the sequence dim 0."""
        shape = list(self.inputs[name].shape)
        symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
        seq = symbolic[-1] if symbolic else len(shape) - 2
        dims = [0 if i == seq else (d if isinstance(d, int) else 1) for i, d in enumerate(shape)]
        return np.zeros(dims, dtype=self._np(name))


def _presents(past: list[str], outputs: list[str]) -> dict[str, str]:
    """Each past input's output: by name (past_key_values.0.key <- present.0.key), else in order."""
    by_name = {}
    for name in past:
        for prefix in PAST_PREFIXES:
            if name.startswith(prefix) and "present" + name[len(prefix):] in outputs:
                by_name[name] = "present" + name[len(prefix):]
                break
    if len(by_name) == len(past):
        return by_name
    if len(outputs) < len(past):
        raise PosdiagError(f"the graph takes {len(past)} past key/values but returns {len(outputs)} other outputs")
    return dict(zip(past, outputs[: len(past)], strict=True))
