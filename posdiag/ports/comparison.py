"""The comparison of a port with its reference, chosen by what the port offers: the one function the command
line asks for a comparison.

Judges run from the richest evidence down: a port with hidden states is compared layer by layer (locating the
first layer that differs), one with logits position by position (its floors measured: the reference's rounding,
a quantisation's own error), one answering top-k log-probs route by route. Each judge is a module with
`judge(reference, candidate, request) -> Comparison`, imported when chosen.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.ports.profile import Comparison
from posdiag.ports.protocol import CompareRequest, Port


@dataclass(frozen=True)
class Judge:
    path: str  # the path (posdiag/ports/protocol.PATHS) a candidate must offer
    module: str  # its judge(reference, candidate, request)
    compares: str  # what it compares, for the error that no judge applies


JUDGES = (
    Judge("hidden_states", "posdiag.ports.layers", "hidden states layer by layer"),
    Judge("logits", "posdiag.ports.logits", "logits position by position"),
    Judge("top_logprobs", "posdiag.ports.served", "top-k log-probs route by route"),
)


def judge_for(candidate: Port) -> Judge:
    """The first judge whose path CANDIDATE offers; PosdiagError (one line) when none is offered."""
    found = next((j for j in JUDGES if j.path in candidate.paths), None)
    if found is None:
        offered = ", ".join(sorted(candidate.paths)) or "nothing"
        raise PosdiagError(f"{candidate.name} offers {offered}; posdiag compares "
                           f"{'; '.join(f'{j.compares} ({j.path})' for j in JUDGES)}")
    return found


def compare(reference: Subject, candidate: Port, request: CompareRequest | None = None) -> Comparison:
    """CANDIDATE against REFERENCE by the judge its paths choose. Never prints; PosdiagError on inputs that cannot
    be compared."""
    judge = judge_for(candidate)
    return importlib.import_module(judge.module).judge(reference, candidate, request or CompareRequest())
