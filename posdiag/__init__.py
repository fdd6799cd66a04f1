"""posdiag: find position-injection bugs in transformer checkpoints.

    from posdiag import check_model
    report = check_model(model)          # an nn.Module, a checkpoint directory or a hub id
    assert report.exit_code == 0, report.check("shuffle").summary

Attributes are imported lazily so `import posdiag` stays cheap (no torch until used).
"""

from __future__ import annotations

from posdiag._version import __version__

__all__ = ["check_model", "__version__"]


def __getattr__(name: str):
    if name == "check_model":
        from posdiag.api import check_model

        return check_model
    raise AttributeError(f"module 'posdiag' has no attribute {name!r}")
