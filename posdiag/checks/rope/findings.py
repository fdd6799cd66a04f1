"""One disagreement with the config, located (layer, q/k, head, position, dim), and how findings rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posdiag.verdict import within_band


@dataclass
class Finding:
    kind: str  # table | applied rotation | pass-through dims | layout | non-finite | attention factor
    ratio: float
    error: float = 0.0
    tolerance: float = 0.0
    layer: int | None = None
    tensor: str = ""
    head: int | None = None
    position: int | None = None
    dim: int | None = None
    expected: float | None = None
    actual: float | None = None
    message: str = ""
    probe: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return not within_band(self.ratio)  # NaN fails

    def labelled(self, label: str) -> Finding:
        self.probe = label
        return self

    def where(self) -> dict[str, Any]:
        out = {k: v for k, v in (("kind", self.kind), ("probe", self.probe), ("layer", self.layer),
                                 ("tensor", self.tensor),
                                  ("head", self.head), ("position", self.position), ("dim", self.dim),
                                  ("expected", self.expected), ("actual", self.actual), ("error", self.error),
                                  ("tolerance", self.tolerance), ("ratio", self.ratio)) if v not in (None, "")}
        out.update(self.extra)
        if self.message:
            out["message"] = self.message
        return out

    def metrics(self) -> dict[str, Any]:
        m = {"worst_ratio": self.ratio, "error": self.error, "tolerance": self.tolerance}
        for k in ("layer", "position", "dim", "expected", "actual"):
            v = getattr(self, k)
            if v is not None:
                m[f"worst_{k}"] = v
        return m

    def sentence(self) -> str:
        if self.message:
            return self.message
        if self.kind == "attention factor":
            return factor_sentence(self)
        where = ", ".join(x for x in (
            f"layer {self.layer}" if self.layer is not None else "", self.tensor,
            f"head {self.head}" if self.head is not None else "",
            f"position {self.position}" if self.position is not None else "",
            f"dim {self.dim}" if self.dim is not None else "") if x)
        exp = (f": expected {self.expected:.6g}, got {self.actual:.6g}"
               if self.expected is not None and self.actual is not None else "")
        return (f"{self.kind} disagrees with the config at {where}{exp} "
                f"(error {self.error:.3g}, {self.ratio:.3g}x the tolerance {self.tolerance:.3g})")


def severity(f: Finding) -> tuple:
    """Failures first, then those that say where (layer/position), then by ratio (NaN counts as worst)."""
    located = f.position is not None or f.layer is not None
    ratio = f.ratio if f.ratio == f.ratio else float("inf")
    return (f.failed, located, ratio)


def factor_sentence(f: Finding) -> str:
    measured = f.extra.get("measured_factor", f.actual)
    exp = f.expected or 0.0
    why = ""
    if exp != 1.0 and abs(measured - 1.0) < abs(measured - exp) / 10:
        why = " (the factor is dropped)"
    elif exp != 1.0 and abs(measured - exp * exp) < abs(measured - exp) / 10:
        why = " (the factor is applied twice)"
    return (f"attention factor on the applied path: layer {f.layer} {f.tensor} is scaled by {measured:.6g}, the config "
            f"expects {exp:.6g}{why}; worst at head {f.head}, position {f.position}: {f.actual:.6g}, "
            f"{f.ratio:.3g}x the rounding bound {f.tolerance:.3g} (measured against {f.extra.get('source', '?')})")
