"""Ports: a model running somewhere other than its reference, compared with it (`posdiag compare`).

protocol (what every candidate offers: paths) -> candidates (open_candidate: the port a spec names) ->
comparison (compare: the judge its paths choose). Engines, one module each, are in engines/; the judges are
layers/ (hidden states), logits/ (logits by position, with a quantised file's floors) and served/ (top-k log-probs
by route); profile, reference and lengths are what the judges share. Nothing is imported here: the llama.cpp child
process starts from this package without torch.
"""
