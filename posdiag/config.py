"""Settings from a config file: `[tool.posdiag]` in pyproject.toml, or a posdiag.toml.

Precedence: command line > config file > built-in defaults. The CLI passes the values the
user typed (it knows which ones were typed); this module only reads and merges.

    [tool.posdiag]
    model = "fixtures/llama-tiny"      # default MODEL when none is given
    skip = ["kernels"]                 # or only = [...]
    seq-len = 64
    seed = 0
    compile = true                     # judge generate()'s compiled path (default: automatic compile off)
    dtype = "float32"
    baseline-margin = 10.0
    fail-on = ["warn", "skip"]         # also fail the gate on these statuses (a FAIL always does)
    require = ["shuffle", "cache"]     # checks that must PASS

    [tool.posdiag.checks.rope]         # per-check settings, handed to that check
    target_length = 32768
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posdiag.errors import PosdiagError

# Keys a config file may set, with the command-line name they stand for.
KEYS = {
    "model": "model", "only": "only", "skip": "skip", "seq-len": "seq_len", "seed": "seed",
    "permutations": "permutations", "dtype": "dtype", "device": "device", "device-map": "device_map",
    "max-memory": "max_memory", "offload-folder": "offload_folder",
    "attn-implementation": "attn_implementation", "upcast": "upcast", "max-batch": "max_batch",
    "trust-remote-code": "trust_remote_code", "revision": "revision", "baseline-margin": "baseline_margin",
    "fail-on": "fail_on", "require": "require", "compile": "compile",
}


def _toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except Exception as exc:
        raise PosdiagError(f"cannot read {path}: {exc}") from None


def find_config(start: Path | None = None) -> Path | None:
    """posdiag.toml, else a pyproject.toml with [tool.posdiag], in the current directory or above."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / "posdiag.toml").is_file():
            return directory / "posdiag.toml"
        pyproject = directory / "pyproject.toml"
        if pyproject.is_file() and "posdiag" in _toml(pyproject).get("tool", {}):
            return pyproject
        if (directory / ".git").exists():
            break
    return None


def read_config(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """-> (settings by CLI name, per-check options). Unknown keys are errors, not silently ignored."""
    data = _toml(path)
    table = data.get("tool", {}).get("posdiag", {}) if path.name == "pyproject.toml" else data.get("posdiag", data)
    settings: dict[str, Any] = {}
    check_options: dict[str, dict[str, Any]] = {}
    for key, value in table.items():
        if key == "checks":
            if not isinstance(value, dict):
                raise PosdiagError(f"{path}: [checks] must be a table of per-check settings")
            check_options = {name: dict(opts) for name, opts in value.items()}
            continue
        name = KEYS.get(key) or KEYS.get(key.replace("_", "-"))
        if name is None:
            raise PosdiagError(f"{path}: unknown setting '{key}' (known: {', '.join(sorted(KEYS))}, checks)")
        if name in ("only", "skip", "fail_on", "require") and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        settings[name] = value
    return settings, check_options


def merge(defaults: dict[str, Any], file_values: dict[str, Any],
          typed: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Effective settings and where each came from."""
    effective, source = {}, {}
    for key, value in defaults.items():
        if key in typed:
            effective[key], source[key] = typed[key], "command line"
        elif key in file_values:
            effective[key], source[key] = file_values[key], "config file"
        else:
            effective[key], source[key] = value, "default"
    return effective, source
