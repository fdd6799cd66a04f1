"""Options every check reads. The CLI builds one `RunOptions`; checks never see typer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoadOptions:
    """How to load MODEL. Mirrors the command-line options one to one."""

    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto = the checkpoint's dtype
    device: str = "auto"
    device_map: str | None = None
    max_memory: str | None = None  # accelerate's budget per device, "0=70GiB,cpu=200GiB" (with device_map)
    offload_folder: str | None = None  # disk-offloaded weights (with device_map); None = a temporary folder
    attn_implementation: str = "eager"  # custom masks need eager; kernels compares the rest
    upcast: bool = False  # judge a half-precision model in float32 instead of the dtype it runs in
    allow_pickle: bool = False  # never unpickle .bin checkpoints unless asked
    max_batch: int | None = None  # rows per forward; None = all rows a check needs in one call


@dataclass(frozen=True)
class RunOptions:
    """seq_len:       tokens per probe sequence; None = min(64, declared context).
    seed:          seeds token sampling and permutations: same seed, same numbers.
    permutations:  random permutations per equivariance test (each gets its consistent twin).
    token_ids:     fixed probe tokens (from --text); None = random ids from the vocabulary.
    check_options: per-check settings by check name (e.g. {"rope": {"target_length": 32768}}).
    compile:       judge generate()'s compiled path (torch.compile of the static-cache forward) on purpose; False
                   (default): transformers' automatic compile is turned off, so the eager path is judged.
    """

    seq_len: int | None = None
    seed: int = 0
    permutations: int = 3
    token_ids: tuple[int, ...] | None = None
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    compile: bool = False

    def for_check(self, name: str) -> dict[str, Any]:
        return dict(self.check_options.get(name, {}))


@dataclass(frozen=True)
class Option:
    """One setting a `[checks.NAME]` config table may give a check: its default and why that default.

    types: the accepted value types (default: the default's own type; an int default also takes no float)."""

    default: Any
    why: str
    types: tuple[type, ...] = ()

    @property
    def accepted(self) -> tuple[type, ...]:
        return self.types or (type(self.default),)

    @property
    def type_name(self) -> str:
        return " or ".join(t.__name__ for t in self.accepted)

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) and bool not in self.accepted:
            return False  # True is an int in Python, never a step count in a config
        return isinstance(value, self.accepted)


DEFAULT_SEQ_LEN = 64


def probe_length(subject: Any, options: RunOptions) -> int:
    """The sequence length a check should use, validated against the declared context."""
    from posdiag.errors import PosdiagError

    declared = subject.max_positions
    if options.token_ids is not None:  # the text sets the length: the error names the text, not an unpassed option
        length = len(options.token_ids)
        given, fix = f"--text gives {length} tokens, which", "; shorten the text"
    elif options.seq_len is not None:
        length = options.seq_len
        given, fix = f"--seq-len {length}", ""
    else:
        length = DEFAULT_SEQ_LEN if declared is None else min(DEFAULT_SEQ_LEN, declared)
        given, fix = f"--seq-len {length}", ""
    if length < 4:
        raise PosdiagError(f"{given} is too short: the probes need at least 4 tokens")
    if declared is not None and length > declared:
        raise PosdiagError(f"{given} exceeds the model's declared context of {declared} tokens{fix}")
    return length


def probe_ids(subject: Any, options: RunOptions, batch: int = 1, seed_offset: int = 0):
    """Probe token ids [batch, T]: the --text tokens repeated, or random ordinary ids."""
    import torch

    length = probe_length(subject, options)
    if options.token_ids is not None:
        row = torch.tensor(options.token_ids, dtype=torch.long, device=subject.device)
        return row[None].expand(batch, -1).clone()
    return subject.sample_ids(batch, length, options.seed + seed_offset)
