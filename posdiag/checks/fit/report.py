"""The sentences and tables of a `fit` result (data only: the console renders them)."""

from __future__ import annotations

from posdiag.checks.fit.judging import MIN_GAIN, Z_BOUND, Comparison, Scored
from posdiag.checks.fit.material import Material
from posdiag.results import Table


def fail_summary(material: Material, configured: Scored, decisive: Comparison,
                 copies: dict[str, dict[int, float]]) -> str:
    alt = decisive.alternative
    return (f"the weights fit {alt.fits}, not {alt.configured}: loss {configured.loss:.2f} -> "
            f"{decisive.scored.loss:.2f} nats over {material.count} {_unit(material)} (z = {decisive.z:.1f})"
            f"{_copy_clause(copies, alt.label)}")


def pass_summary(material: Material, configured: Scored, nearest: Comparison, tried: int, notes: list[str]) -> str:
    text = (f"no alternative fits the weights better ({tried} tried): loss {configured.loss:.2f} nats over "
            f"{material.count} {_unit(material)}; nearest {nearest.alternative.label} at {nearest.scored.loss:.2f} "
            f"(gain {nearest.gain:+.3f} nats, z = {nearest.z:.1f}; FAIL needs z >= {Z_BOUND:g} and a gain >= "
            f"{MIN_GAIN:g})")
    return text + (f"; {'; '.join(notes)}" if notes else "")


def _unit(material: Material) -> str:
    return "tokens" if material.source.startswith("text") else "copy targets"


def _copy_clause(copies: dict[str, dict[int, float]], label: str) -> str:
    mine, theirs = copies.get("configured", {}), copies.get(label, {})
    shared = sorted(set(mine) & set(theirs))
    if not shared:
        return ""
    n = shared[-1]
    return f"; copy accuracy at distance {n} {mine[n]:.2f} -> {theirs[n]:.2f}"


def tables(configured: Scored, comparisons: list[Comparison], copies: dict[str, dict[int, float]],
           decisive: Comparison) -> tuple[Table, ...]:
    rows = [("configured", f"{configured.loss:.3f}", "", "", "")]
    for c in sorted(comparisons, key=lambda c: c.scored.loss):
        rows.append((c.alternative.label, f"{c.scored.loss:.3f}", f"{c.gain:+.3f}", f"{c.z:.1f}",
                     "better" if c.beats else ""))
    out = [Table("loss under each configuration (gain: nats per target over the configured one)",
                 ("configuration", "loss", "gain", "z", ""), tuple(rows))]
    distances = sorted({n for v in copies.values() for n in v})
    if distances:
        out.append(Table("copy accuracy by distance (evidence)", ("configuration", *map(str, distances)),
                         tuple((label, *(f"{acc.get(n, float('nan')):.2f}" for n in distances))
                               for label, acc in copies.items())))
    return tuple(out)
