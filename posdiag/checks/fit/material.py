"""What `fit` scores: the tokens a causal LM was trained to predict, and the copy rows shown as evidence.

Natural text when the checkpoint has a tokenizer (the prose shipped in posdiag/data/prose.txt, or --text), as one
row of up to TEXT_TOKENS tokens: every next token is a target. Without a tokenizer, repeated random sequences
[BOS] x_1 .. x_n x_1 .. x_n whose targets are the second copy (x_2 .. x_n): predictable only by attending back
exactly n tokens, i.e. only through positions. The unigram baseline is the entropy of the targets' own
frequencies (in-sample, so optimistic: beating it means the model uses context).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from importlib import resources

import torch

from posdiag.model.subject import Subject
from posdiag.model.tokenizer import load_tokenizer
from posdiag.options import RunOptions

TEXT_TOKENS = 1024  # tokens of text scored (the shipped prose gives ~1250 through a 49k BPE vocabulary)
SEQUENCE_TOKENS = 256  # longest repeated-sequence row (no tokenizer)
SEQUENCE_TARGETS = 512  # targets of repeated sequences, at least
COPY_DISTANCES = (64, 256, 512)  # evidence on text models: copy accuracy at these distances (within the context)
COPY_ROWS = 1  # rows per copy distance (evidence only: 63, 255 and 511 targets)
SCREEN_TARGETS = 256  # targets the untrained screen compares with their destroyed twins (the first rows' / tokens')


@dataclass(frozen=True)
class Material:
    """ids [B, T]; targets [B, T] (the id to predict at each position, -1 where none); what they are."""

    ids: torch.Tensor
    targets: torch.Tensor
    source: str  # "text (shipped prose, 1024 tokens)" / "repeated random sequences ..."
    unigram: float  # in-sample unigram entropy of the targets, nats
    distances: tuple[int, ...] = ()  # repeated sequences: the copy distance n of each row

    @property
    def count(self) -> int:
        return int((self.targets >= 0).sum())

    def rows(self, start: int, stop: int | None = None) -> Material:
        """Rows start:stop of this material (the same source and baseline)."""
        sl = slice(start, stop)
        return Material(self.ids[sl], self.targets[sl], self.source, self.unigram, self.distances[sl])

    def stacked(self, other: Material) -> Material:
        """These rows and `other`'s (of the same width) as one material, in that order."""
        return Material(torch.cat([self.ids, other.ids]), torch.cat([self.targets, other.targets]), self.source,
                        self.unigram, self.distances + other.distances)

    def head_rows(self, targets: int) -> int:
        """How many leading rows hold at least `targets` targets (all of them when fewer)."""
        per_row = (self.targets >= 0).sum(dim=1).cumsum(0)
        return min(int((per_row < targets).sum()) + 1, self.ids.shape[0])


def destroyed(subject: Subject, material: Material, seed: int, tokens: int = SCREEN_TARGETS) -> Material:
    """The material with the context that makes its targets predictable taken away, for the untrained screen:
    repeated sequences get a fresh random first copy (the same targets, nothing to copy them from); text is the
    first `tokens` + 1 tokens, the first one kept and the rest shuffled (the same tokens, no word order).
    A trained model predicts the material far better than its twin, even with its positions broken (a token's
    own path, bigrams, what the context holds do not need them); an untrained one does not."""
    if material.distances:
        ids = material.ids.clone()
        for r, n in enumerate(material.distances):
            start = int((material.targets[r] >= 0).nonzero()[0, 0])  # the second x_1
            ids[r, start - n:start] = subject.sample_ids(1, n, seed + 97 * r + 1).cpu()[0]
        return Material(ids, material.targets, material.source, material.unigram, material.distances)
    row = material.ids[0, :tokens + 1]
    order = torch.randperm(row.numel() - 1, generator=torch.Generator().manual_seed(seed)) + 1
    ids = torch.cat([row[:1], row[order]])[None]
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -1)], dim=1)
    return Material(ids, targets, "shuffled " + material.source, material.unigram)


def plan_material(subject: Subject, options: RunOptions, settings: dict) -> Material | None:
    """Text through the checkpoint's tokenizer when there is one (or --text ids), else repeated sequences (None
    when the context cannot hold one)."""
    limit = _limit(subject, int(settings.get("text_tokens") or TEXT_TOKENS))
    ids = list(options.token_ids) if options.token_ids is not None else None
    source = "--text"
    if ids is None:
        ids, source = _shipped_text(subject)
    if ids is not None and len(ids) >= 8:
        ids = ids[:limit]
        row = torch.tensor([ids], dtype=torch.long)
        targets = torch.cat([row[:, 1:], torch.full((1, 1), -1)], dim=1)
        return Material(row, targets, f"text ({source}, {len(ids)} tokens)", _entropy(ids[1:]))
    return repeated_sequences(subject, options.seed, min(limit, SEQUENCE_TOKENS), reason=source)


def repeated_sequences(subject: Subject, seed: int, longest: int, reason: str = "") -> Material | None:
    """[BOS] x x rows at one or two copy distances, enough rows for SEQUENCE_TARGETS targets (None when `longest`
    cannot hold x x with at least 3 tokens in x)."""
    prefix = _bos(subject)
    top = (longest - len(prefix)) // 2
    if top < 3:
        return None
    distances = sorted({top, max(3, top // 2)}, reverse=True)  # the rows with most targets first (the screen's)
    rows, targets, dists = [], [], []
    for k, n in enumerate(distances):
        count = max(2, math.ceil(SEQUENCE_TARGETS / len(distances) / max(1, n - 1)))
        x = subject.sample_ids(count, n, seed + 31 * k).cpu()
        for r in range(count):
            seq = torch.tensor(prefix + x[r].tolist() * 2, dtype=torch.long)
            want = torch.full_like(seq, -1)
            start = len(prefix) + n  # the second x_1; it predicts x_2
            want[start:start + n - 1] = seq[start + 1:start + n]
            rows.append(seq)
            targets.append(want)
            dists.append(n)
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([r, r.new_full((width - len(r),), r[-1])]) for r in rows])
    want = torch.stack([torch.cat([t, t.new_full((width - len(t),), -1)]) for t in targets])
    scored = want[want >= 0].tolist()
    why = f"; no text: {reason}" if reason and reason != "--text" else ""
    source = f"repeated random sequences (copy distances {', '.join(map(str, sorted(distances)))}{why})"
    return Material(ids, want, source, _entropy(scored), tuple(dists))


def copy_rows(subject: Subject, seed: int, distances: tuple[int, ...] = COPY_DISTANCES) -> list[Material]:
    """Evidence rows for a text model: repeated sequences at each distance that fits the context, one group per
    distance (rows of one length: no padding)."""
    prefix = _bos(subject)
    limit = _limit(subject, 2 * max(distances, default=0) + len(prefix))
    groups = []
    for n in (n for n in distances if 2 * n + len(prefix) <= limit):
        x = subject.sample_ids(COPY_ROWS, n, seed + 7 * n).cpu()
        ids = torch.cat([torch.tensor([prefix] * COPY_ROWS, dtype=torch.long).reshape(COPY_ROWS, -1), x, x], dim=1)
        want = torch.full_like(ids, -1)
        start = len(prefix) + n  # the second x_1; it predicts x_2
        want[:, start:start + n - 1] = ids[:, start + 1:start + n]
        groups.append(Material(ids, want, f"copy distance {n}", 0.0, (n,) * COPY_ROWS))
    return groups


def _shipped_text(subject: Subject) -> tuple[list[int] | None, str]:
    tokenizer, why = load_tokenizer(subject)
    if tokenizer is None:
        return None, why
    text = resources.files("posdiag.data").joinpath("prose.txt").read_text(encoding="utf-8")
    ids = [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]
    if any(i >= subject.vocab_size or i < 0 for i in ids):
        return None, "its tokenizer gives ids outside the model's vocabulary"
    return ids, "shipped prose"


def _bos(subject: Subject) -> list[int]:
    bos = getattr(subject.config, "bos_token_id", None)
    return [bos] if isinstance(bos, int) and 0 <= bos < subject.vocab_size else []


def _limit(subject: Subject, wanted: int) -> int:
    """Tokens one row may hold: the declared context, less two rows of a learned table (the ±2 offsets)."""
    declared = subject.max_positions
    if declared is None:
        return wanted
    spare = 2 if subject.position_kind in ("learned", "sinusoidal") else 0
    return max(4, min(wanted, declared - spare))


def _entropy(targets: list[int]) -> float:
    counts = Counter(targets)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values()) if total else float("nan")
