"""Whether a checkpoint's weights are still as transformers initialises them: the second witness, beside the screen's
measured context gain, that a model predicting like an untrained one carries no training (`fit` is then N/A).

transformers' `_init_weights` draws every matrix (linear, embedding) from N(0, initializer_range) or a smaller scaled
normal (GPT-2's output projections: / sqrt(2 x layers)), sets every norm weight to 1 and every bias to 0. Training moves
every one of those: a trained model broken past use (its context no help) still has norm weights that differ from one
another. So: every 1-D parameter constant, every matrix centred with a spread at most INIT_SPREAD x the config's
initializer_range. Anything else (no initializer_range, offloaded weights, another init) is not evidence: the
screen's SKIP stands.

Measured on the fixtures saved at default init (llama-tiny, gpt2-tiny): every matrix's spread 0.98-1.03x
initializer_range (GPT-2's c_proj 0.50x), every norm weight 1 and bias 0. The real SmolLM2-135M: none of its 61 norm
weights constant (values -2.1 to 3.3), its matrices' spread 2.3-20x its initializer_range 0.02.
"""

from __future__ import annotations

import torch

from posdiag.model.subject import Subject

INIT_SPREAD = 1.1  # x initializer_range: a matrix of 1024+ draws has its sample spread within ~2% of the true one
CENTRED = 0.1  # |mean| at most this x initializer_range


def at_initialisation(subject: Subject) -> str | None:
    """The evidence that every weight is as transformers initialises it (one line), or None where it is not (or
    cannot be told)."""
    scale = getattr(subject.config, "initializer_range", None)
    if not isinstance(scale, (int, float)) or scale <= 0:
        return None
    matrices = constants = 0
    widest = 0.0
    with torch.no_grad():
        for _, param in subject.model.named_parameters():
            if param.device.type == "meta" or not param.is_floating_point() or param.numel() == 0:
                return None
            values = param.detach().float()
            if values.ndim == 1:
                if not bool((values == values[0]).all()):
                    return None
                constants += 1
                continue
            spread, mean = float(values.std()) if values.numel() > 1 else 0.0, float(values.mean())
            if spread > INIT_SPREAD * scale or abs(mean) > CENTRED * scale:
                return None
            matrices += 1
            widest = max(widest, spread / scale)
    if not constants or not matrices:
        return None  # no norm weight or bias to witness it: the matrices alone could be small trained weights
    return (f"its weights are as transformers initialises them ({constants} norm weights and biases constant, "
            f"{matrices} matrices centred with spread at most {widest:.2f}x initializer_range {scale:g})")
