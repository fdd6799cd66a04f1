"""A PyTorch model in this process as a candidate: a checkpoint, or the torch.nn.Module a user's factory returns.

The one port that shows every layer: posdiag/ports/layers/ compares it with the reference hidden state by hidden
state. Loading is the model layer's (posdiag.model.loading), with the candidate's own dtype and attention options.
"""

from __future__ import annotations

from dataclasses import dataclass

from posdiag.model.subject import Subject


@dataclass
class ModelPort:
    subject: Subject

    @property
    def name(self) -> str:
        return self.subject.spec

    @property
    def paths(self) -> frozenset[str]:
        return frozenset({"hidden_states"})

    @property
    def vocab_size(self) -> int | None:
        return self.subject.vocab_size
