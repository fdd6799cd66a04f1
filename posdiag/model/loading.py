"""Loading MODEL (hub id, checkpoint directory, module:factory or an in-memory module) into a Subject.

Every failure becomes a PosdiagError with one line of advice (exit code 2). Half-precision
models are judged in the dtype they run in; --upcast judges the function in float32 instead.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any, TypeVar

import torch

from posdiag.errors import PosdiagError, one_line
from posdiag.model.checkpoint import weight_files
from posdiag.model.classes import auto_class, text_route
from posdiag.model.families import Family, family_for, for_model
from posdiag.model.introspect import detect_position_kind
from posdiag.model.kinds import Kind, PositionKind
from posdiag.model.placement import (
    input_device,
    is_dispatched,
    parse_max_memory,
    placement_note,
)
from posdiag.model.precision import float32_copy_refused, memory_allows, weight_bytes
from posdiag.model.pretrained import (
    LoadPlan,
    check_spec,
    from_pretrained,
    load_info,
    plan_load,
    read_config,
)
from posdiag.model.subject import LoadInfo, Subject
from posdiag.model.tensors import DTYPES, dtype_name
from posdiag.model.towers import language_config
from posdiag.options import LoadOptions

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PosdiagError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise PosdiagError("--device mps: MPS is not available on this machine (use --device cpu)")
    return torch.device(name)


def from_module(model: torch.nn.Module, *, name: str = "in-memory model",
                options: LoadOptions | None = None) -> Subject:
    """Wrap an already-built model (unit tests, the Python API): nothing is loaded or written."""
    options = options or LoadOptions()
    config = getattr(model, "config", None)
    is_hf = config is not None and hasattr(config, "model_type") and hasattr(model, "get_input_embeddings")
    param = next(iter(model.parameters()), None)
    load_dtype = param.dtype if param is not None else torch.float32
    device = input_device(model)
    tested = ""
    if is_hf:
        inner, tested = text_route(model)
        family = for_model(family_for(config if inner is model else inner.config), inner)
        model = inner
        config = language_config(config) if model.config is config else model.config
        _check_attn_implementation(model, options)
    else:
        config = _CustomConfig(model)
        family = Family(name="custom", kind=_declared(model, "posdiag_kind", Kind, Kind.CAUSAL),
                        position_kind=_declared(model, "posdiag_position_kind", PositionKind, PositionKind.NONE))
    subject = Subject(
        model=model.eval(), config=config, family=family, spec=name, kind=family.kind,
        position_kind=family.position_kind, dtype=load_dtype, load_dtype=load_dtype, device=device,
        load_info=LoadInfo(checkpoint_keys=None, source="in-memory module"),
        options=options, is_hf=is_hf, tested=tested,
    )
    _detect_position_kind(subject)
    _maybe_upcast(subject)
    return subject


def _declared(model: torch.nn.Module, attr: str, members: type[T], default: T) -> T:
    """What a factory model declares about itself (`model.posdiag_kind`), one of `members`."""
    value = getattr(model, attr, default)
    try:
        return members(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in members)
        raise PosdiagError(f"model.{attr} = {value!r} is not one of {allowed}") from None


class _CustomConfig:
    """Stand-in config for factory models: reads what it can off the module."""

    model_type = "custom"

    def __init__(self, model: torch.nn.Module):
        cfg = getattr(model, "posdiag_config", None) or {}
        for k, v in dict(cfg).items():
            setattr(self, k, v)
        if not hasattr(self, "vocab_size"):
            emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            if emb is None:
                emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
            if emb is not None:
                self.vocab_size = emb.num_embeddings


def _check_attn_implementation(model: torch.nn.Module, options: LoadOptions) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in (None, "eager") and options.attn_implementation == "eager":
        # Explicit-mask checks are only faithful under eager attention (see DESIGN pitfalls).
        try:
            model.set_attn_implementation("eager")
        except Exception as exc:  # pragma: no cover - depends on the family
            raise PosdiagError(f"cannot switch the model to eager attention: {exc}") from None


def check_load_options(options: LoadOptions) -> None:
    """What the load options ask for, checked before anything is read (the command line calls it before it loads
    any model, a reference and a candidate alike): the device is on this machine, a memory budget parses, the
    placement options come with --device-map, an offload folder is not a file."""
    if not options.device_map:
        for given, flag in ((options.max_memory, "--max-memory"), (options.offload_folder, "--offload-folder")):
            if given:
                raise PosdiagError(f"{flag} only applies with --device-map (e.g. --device-map auto)")
    elif options.max_memory:
        parse_max_memory(options.max_memory)  # a malformed budget fails before anything is read
    if options.offload_folder and Path(options.offload_folder).expanduser().is_file():
        raise PosdiagError(f"--offload-folder {options.offload_folder} is a file, not a folder")
    resolve_device(options.device)


def load_subject(spec: str, options: LoadOptions | None = None) -> Subject:
    """MODEL -> Subject. Every failure becomes a PosdiagError with one line of advice."""
    options = options or LoadOptions()
    check_load_options(options)
    if looks_like_factory(spec):
        return _load_factory(spec, options)
    return _load_pretrained(spec, options)


def looks_like_factory(spec: str) -> bool:
    if ":" not in spec or os.path.exists(spec):
        return False
    module, _, attr = spec.rpartition(":")
    return bool(module) and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))


def call_factory(spec: str) -> Any:
    """Import `module.path:factory` (the current directory is importable) and call it; every failure is one
    PosdiagError line. Models and engines (posdiag compare) are built this way."""
    module_name, _, attr = spec.rpartition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PosdiagError(f"cannot import factory module '{module_name}': {one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PosdiagError(f"'{attr}' in module '{module_name}' is not a callable factory")
    try:
        return factory()
    except Exception as exc:
        raise PosdiagError(f"factory '{spec}' raised {type(exc).__name__}: {one_line(exc)}") from None


def _load_factory(spec: str, options: LoadOptions) -> Subject:
    if options.device_map:
        raise PosdiagError("--device-map needs a checkpoint to place: a module:factory model is built in memory "
                           "(dispatch it with accelerate inside the factory instead)")
    model = call_factory(spec)
    if not isinstance(model, torch.nn.Module):
        raise PosdiagError(f"factory '{spec}' returned {type(model).__name__}, not a torch.nn.Module")
    return from_factory_model(model, spec, options)


def from_factory_model(model: torch.nn.Module, spec: str, options: LoadOptions) -> Subject:
    """A model a `module:factory` returned, placed on the device and dtype the options ask for."""
    device = resolve_device(options.device)
    dtype = None if options.dtype == "auto" else DTYPES[options.dtype]
    model = _cast_keeping_frequencies(model, device, dtype) if dtype is not None else model.to(device)
    subject = from_module(model, name=spec, options=options)
    subject.load_info = LoadInfo(checkpoint_keys=None, source=f"factory {spec}")
    return subject


def _cast_keeping_frequencies(model: torch.nn.Module, device: Any, dtype: torch.dtype) -> torch.nn.Module:
    """model.to(dtype) for --dtype, its RoPE frequency buffers (`*inv_freq`) kept in their own dtype, as
    from_pretrained keeps them (it recomputes them in float32 at load). Cast to bfloat16 they round to 3 digits and
    the rotation is wrong past a few thousand positions (a factory's Llama-3.1 shape in bfloat16: cos 1 where 0.98
    is due at position 62133): posdiag must not plant the bug it looks for."""
    kept = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
            if name.endswith("inv_freq") and isinstance(buf, torch.Tensor) and buf.is_floating_point()]
    model = model.to(device=device, dtype=dtype)
    for module, name, buf in kept:
        module._buffers[name] = buf.to(device)
    return model


def _load_pretrained(spec: str, options: LoadOptions) -> Subject:
    """A checkpoint directory or hub id: config, weight files, from_pretrained, then the Subject with its notes."""
    local = Path(spec)
    if local.is_file() and local.suffix.lower() == ".gguf":
        return _load_gguf(local, options)
    is_local = check_spec(spec, local)
    config = read_config(spec, options, is_local)
    family = family_for(config)
    auto_cls = auto_class(config, family)
    weights = weight_files(spec, options, is_local)
    if weights["source"] == "pickle" and not options.allow_pickle:
        raise PosdiagError(f"'{spec}' ships only pickle weights (.bin); unpickling can run code. "
                           "Convert to safetensors or pass --allow-pickle")
    device = resolve_device(options.device) if not options.device_map else None
    plan = plan_load(spec, options, config, weights)
    model, loading_info, notes = from_pretrained(auto_cls, spec, options, plan)
    if device is not None:
        model = model.to(device)
    model.eval()
    inner, tested = text_route(model)
    family = for_model(family if inner is model else family_for(inner.config), inner)
    model = inner
    param = next(iter(model.parameters()))  # its dtype; its device may be "meta" when offloaded
    subject = Subject(
        model=model, config=language_config(model.config), family=family, spec=spec, kind=family.kind,
        position_kind=family.position_kind,
        dtype=param.dtype, load_dtype=plan.stored if plan.upcast_at_load else param.dtype, device=input_device(model),
        load_info=load_info(weights, loading_info, config, model, options), options=options, tested=tested,
    )
    _detect_position_kind(subject)
    # Removed by Subject.close(), else when the model is collected, else at interpreter exit.
    subject.cleanup = [weakref.finalize(model, shutil.rmtree, folder, True) for folder in plan.temporary]
    _note_placement(subject, options, plan, notes)
    _maybe_upcast(subject)
    return subject


def _note_placement(subject: Subject, options: LoadOptions, plan: LoadPlan, notes: list[str]) -> None:
    if options.device_map:
        subject.notes += [placement_note(subject.model, options)] + notes
    if plan.upcast_at_load:
        name = dtype_name(plan.stored)
        subject.notes.append(f"loaded in float32 from {name} weights (--device-map: the map was planned for the "
                             f"float32 size, twice {name}'s; --no-upcast keeps {name})")


def _load_gguf(path: Path, options: LoadOptions) -> Subject:
    """A .gguf file as a MODEL: validated (posdiag.model.gguf_file), then dequantised by transformers' GGUF
    support into its PyTorch class, tokenizer included. Nothing is written anywhere: transformers reads the
    file in place and keeps the dequantised weights in memory."""
    from posdiag.model.gguf_file import inspect_file, parsed_once
    from posdiag.model.tokenizer import gguf_tokenizer

    if options.device_map:
        raise PosdiagError("--device-map places checkpoint files; a .gguf file is dequantised into memory")
    info = inspect_file(str(path))  # parsed once per command (gguf_file.one_parse_per_file)
    dtype = torch.float32 if options.dtype == "auto" else DTYPES[options.dtype]
    with parsed_once(info.reader):  # config, model and tokenizer: one parse of the file, not six
        family, model, loading = _dequantised(path, info, dtype, options)
        tokenizer = gguf_tokenizer(path, options)
    model.hf_quantizer = None  # the weights are plain tensors now; the GGUF marker only refuses copies
    model = model.to(resolve_device(options.device)).eval()
    inner, tested = text_route(model)
    family = for_model(family if inner is model else family_for(inner.config), inner)
    stored = f"dequantised from {info.file_type} GGUF"
    missing = tuple(loading.get("missing_keys", ()) or ())
    provided = tuple(k for k in model.state_dict() if k not in set(missing))  # the file's tensors, as mapped
    subject = Subject(
        model=inner, config=language_config(inner.config), family=family, spec=str(path), kind=family.kind,
        position_kind=family.position_kind, dtype=dtype, load_dtype=dtype, device=input_device(inner),
        load_info=LoadInfo(checkpoint_keys=provided, missing_keys=missing, files=(str(path),), source=stored),
        options=options, tested=tested, tokenizer=tokenizer,
    )
    types = ", ".join(f"{t} x{n}" for t, n in sorted(info.type_counts.items()))
    subject.notes.append(f"{stored} by transformers (tensors: {types})")
    _detect_position_kind(subject)
    return subject


def _dequantised(path: Path, info: Any, dtype: torch.dtype,
                 options: LoadOptions) -> tuple[Family, torch.nn.Module, dict]:
    """(the config's family, model, loading info): transformers' GGUF support reading the file in place."""
    from transformers import AutoConfig

    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    try:
        config = AutoConfig.from_pretrained(**where)
    except Exception as exc:
        text = one_line(exc)
        if "not supported" in text or "Unrecognized" in text or "architecture" in text:
            raise PosdiagError(f"'{path}': transformers cannot map GGUF architecture '{info.arch}' to a PyTorch "
                               f"model ({text[:120]})") from None
        raise PosdiagError(f"cannot read '{path}' as a GGUF model: {text[:200]}") from None
    family = family_for(config)
    torch.manual_seed(0)
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    gguf_utils.tqdm = lambda items, **_: items  # its progress bar ignores transformers' own switch
    try:
        model, loading = auto_class(config, family).from_pretrained(
            **where, dtype=dtype, attn_implementation=options.attn_implementation, output_loading_info=True)
    except Exception as exc:
        raise PosdiagError(f"cannot dequantise '{path}': {one_line(exc)}") from None
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    return family, model, loading


def _detect_position_kind(subject: Subject) -> None:
    """For a family without a row: sniffed from the language model's modules alone. The towers posdiag does not
    test carry rotary modules of their own (Nemotron 3.5 Transcribe's audio encoder), which made a NoPE + Mamba
    language model read as RoPE and `shift` fail it for positions that move nothing."""
    if subject.position_kind == PositionKind.NONE:
        subject.position_kind = detect_position_kind(subject.language_model)


def _maybe_upcast(subject: Subject) -> None:
    """A half-precision model is judged as stored: bfloat16's bugs (positions rounded before the angles) exist only
    there (posdiag.half_precision says which checks run in which dtype). --upcast asks for the function in
    float32 instead."""
    if subject.dtype not in (torch.float16, torch.bfloat16):
        return
    if not subject.options.upcast:
        subject.notes.append(f"judged as stored in {dtype_name(subject.dtype)}: rope, shift, kernels and table run in "
                             f"it; the other checks decide with the same weights held in float32 and the agreement "
                             f"checks read their paths once more in {dtype_name(subject.dtype)} (--upcast judges "
                             "every check in float32)")
        refused = float32_copy_refused(subject)
        if refused:
            subject.notes.append(f"every check runs in {dtype_name(subject.dtype)}, float64 re-runs deciding: "
                                 f"{refused}")
        return
    if is_dispatched(subject.model):
        subject.notes.append("kept in half precision: a model dispatched by accelerate cannot be re-cast in place "
                             "(--dtype float32 loads it in float32)")
        return
    extra = weight_bytes(subject, torch.float32) - weight_bytes(subject, subject.dtype)
    if subject.device.type == "cuda" and not memory_allows(subject, extra, 0.8):
        subject.notes.append("kept in half precision: not enough free GPU memory to upcast")
        return
    subject.model.to(torch.float32)
    subject.dtype = torch.float32
    subject.notes.append(f"upcast from {dtype_name(subject.load_dtype)} to float32 for the checks "
                         "(--no-upcast keeps it)")
