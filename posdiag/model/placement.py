"""Placement by accelerate (--device-map): where inputs go, the memory budget, disk offload.

posdiag never writes into the checkpoint: the offload folder is temporary by default and
refused inside the checkpoint directory. Offloaded weights are meta tensors in the model;
`stored_weight` reads (and temporarily replaces) them through accelerate's weights map.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.options import LoadOptions


def is_dispatched(model: torch.nn.Module) -> bool:
    """accelerate placed the model on several devices or on disk (hooks move weights and inputs)."""
    placement = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    return len(placement) > 1 or "disk" in placement


def input_device(model: torch.nn.Module) -> torch.device:
    """Where inputs go. A dispatched model runs offloaded (cpu/disk) blocks on its first
    accelerator (accelerate's main device), else on the CPU; otherwise: its first parameter's."""
    if is_dispatched(model):
        placed = [d for d in model.hf_device_map.values() if str(d) not in ("cpu", "disk")]
        if not placed:
            return torch.device("cpu")
        main = placed[0]
        return torch.device("cuda", main) if isinstance(main, int) else torch.device(main)
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?$", re.IGNORECASE)


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_max_memory(text: str) -> dict[int | str, int]:
    """'0=70GiB,cpu=200GiB' -> {0: 75161927680, 'cpu': 214748364800}: accelerate's max_memory
    (GPU index or cpu/mps/disk -> bytes). Sizes take B, KB/MB/GB/TB or KiB/MiB/GiB/TiB."""
    usage = f"--max-memory '{text}': expected DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,cpu=200GiB"
    budget: dict[int | str, int] = {}
    for item in text.split(","):
        key, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not key or not size:
            raise PosdiagError(usage)
        key = key.lower().removeprefix("cuda:")
        if key.isdigit():
            device: int | str = int(key)
        elif key in ("cpu", "mps", "disk"):
            device = key
        else:
            raise PosdiagError(f"--max-memory: unknown device '{key}' (a GPU index such as 0, or cpu, mps, disk)")
        match = _SIZE.match(size)
        if match is None:
            raise PosdiagError(f"--max-memory: size '{size}' for {key} is not a size such as 2GiB, 500MB or 1048576")
        if device in budget:
            raise PosdiagError(f"--max-memory: {key} is given twice")
        budget[device] = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    return budget


def device_map_kwargs(spec: str, options: LoadOptions, weights: dict[str, Any], temporary: list[str]) -> dict[str, Any]:
    """from_pretrained's device_map / max_memory / offload_folder. Always an offload folder:
    transformers re-saves there what it cannot read from the checkpoint's safetensors in place
    (pickle weights, converted MoE experts) and fails without one. It is never inside the
    checkpoint (posdiag never writes there); the default is temporary and removed after the run."""
    kwargs: dict[str, Any] = {"device_map": options.device_map}
    if options.max_memory:
        budget = parse_max_memory(options.max_memory)
        gpus = torch.cuda.device_count()
        for device in budget:
            if isinstance(device, int) and device >= gpus:
                raise PosdiagError(f"--max-memory: GPU {device} is not on this machine ({gpus} CUDA device(s))")
        kwargs["max_memory"] = budget
    if options.offload_folder:
        folder = Path(options.offload_folder).expanduser().resolve()
        for root in checkpoint_dirs(spec, weights):
            if folder == root or root in folder.parents:
                raise PosdiagError(f"--offload-folder {options.offload_folder} is inside the checkpoint directory "
                                   f"{root}: posdiag never writes into the checkpoint; choose a folder elsewhere")
        if folder.exists() and not folder.is_dir():
            raise PosdiagError(f"--offload-folder {options.offload_folder} is a file, not a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PosdiagError(f"--offload-folder {options.offload_folder}: cannot create it "
                               f"({exc.strerror})") from None
    else:
        folder = Path(tempfile.mkdtemp(prefix="posdiag-offload-"))
        temporary.append(str(folder))
    kwargs["offload_folder"] = str(folder)
    return kwargs


def checkpoint_dirs(spec: str, weights: dict[str, Any]) -> set[Path]:
    """Every directory the checkpoint lives in: the local folder, the hub snapshot and its blobs."""
    roots = {Path(spec).resolve()} if Path(spec).is_dir() else set()
    for f in weights["files"]:
        roots |= {Path(f).parent.resolve(), Path(f).resolve().parent}
    return roots


def offload_map(module: torch.nn.Module) -> Any:
    """accelerate's weights map for a module whose weights it offloaded (None: not offloaded)."""
    hook = getattr(module, "_hf_hook", None)
    maps = [getattr(h, "weights_map", None) for h in getattr(hook, "hooks", (hook,))]
    return next((m for m in maps if m is not None), None)


def unreadable_offloaded(model: torch.nn.Module) -> list[str]:
    """Offloaded (meta) weights for which accelerate holds no values: neither in memory nor in its
    disk index. Checked by name only: nothing is read from disk."""
    lost = []
    for module_name, module in model.named_modules():
        weights = offload_map(module)
        if weights is None:
            continue
        base, prefix = getattr(weights, "dataset", weights), getattr(weights, "prefix", "")
        known = (set(getattr(base, "state_dict", {})) | set(getattr(base, "index", {})) if hasattr(base, "index")
                 else set(base))
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        lost += [f"{module_name}.{attr}" if module_name else attr
                 for attr, tensor in own if tensor.device.type == "meta" and prefix + attr not in known]
    return lost


def kept_in_memory(placement: dict[str, Any], model: torch.nn.Module, names: list[str]) -> dict[str, Any]:
    """`placement` with the modules owning `names` moved from disk to the CPU; coarser entries
    ("" = the whole model) are split into their children and own tensors down to those modules."""
    placement = dict(placement)
    for name in names:
        owner = name.rpartition(".")[0]
        while True:
            covering = [k for k in placement if k == "" or owner == k or owner.startswith(k + ".")]
            entry = max(covering, key=len, default=None)
            if entry is None or placement[entry] != "disk":
                break
            if entry == owner:
                placement[entry] = "cpu"
                break
            module, prefix, device = model.get_submodule(entry), f"{entry}." if entry else "", placement.pop(entry)
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for part in [n for n, _ in module.named_children()] + [n for n, _ in own]:
                placement[prefix + part] = device
    return placement


def placement_note(model: torch.nn.Module, options: LoadOptions) -> str:
    """Where accelerate put the model (hf_device_map: modules, or single tensors), per device."""
    parts: dict[str, list[str]] = {}
    for name, device in (getattr(model, "hf_device_map", None) or {}).items():
        key = f"cuda:{device}" if isinstance(device, int) else str(device)
        parts.setdefault(key, []).append(name or "(whole model)")
    where = "; ".join(f"{device}: {', '.join(names)}" if len(names) <= 4 else
                      f"{device}: {len(names)} parts ({names[0]}, …, {names[-1]})" for device, names in parts.items())
    text = f"--device-map {options.device_map}: {where}"
    if "disk" in parts:
        text += (" (disk parts are read at every forward: from the checkpoint's safetensors, or from the offload "
                 "folder where transformers had to re-save them)")
    return text


@contextlib.contextmanager
def stored_weight(model: torch.nn.Module, name: str) -> Iterator[torch.Tensor]:
    """Parameter or buffer `name` with its values, also when accelerate offloaded it.

    An offloaded weight is a meta tensor in the model: accelerate reads the real one from
    its weights map (CPU copies, or the checkpoint's safetensors for disk) before each
    forward. This installs a private CPU copy in that map and yields it, so in-place edits
    inside the block reach the next forward and nothing is written to disk; the map is
    restored on exit. A weight that is not offloaded is yielded as it is.
    """
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    tensor = getattr(module, attr)
    if tensor.device.type != "meta":
        yield tensor
        return
    weights = offload_map(module)
    if weights is None:
        raise RuntimeError(f"{name} is on the meta device and no accelerate hook holds its values")
    base, key = getattr(weights, "dataset", weights), getattr(weights, "prefix", "") + attr
    store = getattr(base, "state_dict", base)  # OffloadedWeightsLoader: its in-memory dict wins over disk
    had, old = key in store, store.get(key)
    copy = weights[attr].detach().to("cpu", copy=True)
    store[key] = copy
    try:
        yield copy
    finally:
        if had:
            store[key] = old
        else:
            del store[key]
