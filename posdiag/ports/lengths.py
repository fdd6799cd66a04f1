"""How long a probe may be: the lengths a reference declares, which every comparison of a port respects."""

from __future__ import annotations

from posdiag.model.subject import Subject

DEFAULT_SEQ_LEN = 512
"""Several hundred tokens: long enough that low-frequency RoPE pairs turn visibly, short enough for CPU."""


def original_context(subject: Subject) -> int | None:
    """The training context before any scaling: rope_parameters' original_max_position_embeddings
    (per layer type too), else the declared context."""
    values: list[int] = []
    for obj in (getattr(subject.config, "rope_parameters", None), getattr(subject.config, "rope_scaling", None)):
        blocks = [obj] if isinstance(obj, dict) else []
        if isinstance(obj, dict) and any(isinstance(v, dict) for v in obj.values()):
            blocks = [v for v in obj.values() if isinstance(v, dict)]
        for block in blocks:
            value = block.get("original_max_position_embeddings")
            if isinstance(value, int) and value > 0:
                values.append(value)
    value = getattr(subject.config, "original_max_position_embeddings", None)
    if isinstance(value, int) and value > 0:
        values.append(value)
    return min(values) if values else subject.max_positions
