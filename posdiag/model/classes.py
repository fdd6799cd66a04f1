"""Which class to build for a checkpoint, and which part of it the checks drive.

The auto class comes from what the checkpoint is (its declared architecture in transformers' auto mappings,
then its kind); a vision-language model is driven through its language model with text inputs; code a
checkpoint ships (auto_map) and did not run is named.
"""

from __future__ import annotations

from typing import Any

import torch

from posdiag.errors import one_line
from posdiag.model.families import Family
from posdiag.model.placement import input_device
from posdiag.model.towers import tested_tower


def text_route(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The module the checks drive with text inputs, and what the report header says was tested.

    A multimodal model's checks run on its language model with text inputs, through the model's own forward:
    that is the path users run (it builds the mRoPE position streams and the masks, and generate() carries
    rope_deltas), and measured on tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma3, Mistral3, LLaVA, PaliGemma,
    Idefics3 and SmolVLM every check runs through it. Where that forward raises on text inputs, the complete
    causal LM the model holds is driven alone (Llama4ForConditionalGeneration.forward in transformers 5.24
    reads `image_outputs` off its language model's output and raises AttributeError on every call), and the
    header says so."""
    tested = tested_tower(model)
    if not tested:
        return model, ""
    error = _text_forward_error(model)
    inner = getattr(model, "language_model", None)
    if error is None or not (isinstance(inner, torch.nn.Module) and hasattr(inner, "get_output_embeddings")
                             and inner.get_output_embeddings() is not None):
        return model, tested
    towers = tested.split("; ", 1)[1]
    return inner.eval(), (f"language model {type(inner).__name__} of {type(model).__name__}, driven alone "
                          f"({type(model).__name__}.forward raised {error} on text inputs); {towers}")


def _text_forward_error(model: torch.nn.Module) -> str | None:
    ids = torch.tensor([[4, 5]], device=input_device(model))
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, output_hidden_states=True, return_dict=True)
    except Exception as exc:
        return f"{type(exc).__name__}: {one_line(exc)}"[:160]
    return None


def shipped_code(config: Any, model: torch.nn.Module, trusted: bool) -> dict[str, Any]:
    """The checkpoint's own modeling code (config.json's auto_map) and, when the loaded class is not that
    code, why (LoadInfo fields).

    Without --trust-remote-code transformers ignores auto_map when it knows the model_type and builds its
    own class for it, so the checks test that class, not the code the checkpoint ships. Code loaded from the
    checkpoint lives in transformers' dynamic `transformers_modules` package, never in `transformers.`."""
    auto_map = getattr(config, "auto_map", None) or {}
    if not isinstance(auto_map, dict) or not auto_map:
        return {}
    auto_map = {str(k): str(v[0] if isinstance(v, (list, tuple)) else v) for k, v in auto_map.items()}
    if not type(model).__module__.startswith("transformers."):
        return {"shipped_code": auto_map}
    where = ", ".join(f"{k}: {v}" for k, v in auto_map.items())
    why = ("its auto_map names none of it for the auto class posdiag loads, so" if trusted
           else "without --trust-remote-code")
    return {"shipped_code": auto_map,
            "untested_code": f"the checkpoint ships its own modeling code (auto_map: {where}); {why} posdiag tested "
                             f"transformers' built-in {type(model).__name__}, not that code"}


# (auto class, its mapping in transformers.models.auto.modeling_auto), in the order a checkpoint's declared
# architecture is looked up. Vision-language checkpoints (Qwen2-VL, LLaVA, PaliGemma...) are in none of the
# text mappings: AutoModelForCausalLM raises "Unrecognized configuration class" on them.
_AUTO = (
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModel", "MODEL_MAPPING_NAMES"),
)


def auto_class(config: Any, family: Family):
    """The auto class that builds what the checkpoint is.

    The class the checkpoint declares (`architectures`) wins where an auto mapping builds it for this model
    type: a Llama4 checkpoint saved as Llama4ForConditionalGeneration loads as that (AutoModelForCausalLM
    would build the text-only Llama4ForCausalLM and re-initialise every weight under its other prefix).
    Otherwise by kind: encoders as the base model (its last_hidden_state is the representation),
    encoder-decoders with their LM head, decoders with theirs, then image-text-to-text, then the base model.
    Model types in no mapping (remote code) go to AutoModelForCausalLM, which says what it cannot build.
    """
    import transformers
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    built = {auto: _names(getattr(modeling_auto, mapping).get(model_type)) for auto, mapping in _AUTO}
    declared = set(getattr(config, "architectures", None) or ())
    for auto, _ in _AUTO:
        if declared & built[auto] and not (family.kind == "encoder" and built["AutoModel"]):
            return getattr(transformers, auto)
    if family.kind == "seq2seq" or getattr(config, "is_encoder_decoder", False):
        order = ("AutoModelForSeq2SeqLM", "AutoModelForImageTextToText", "AutoModel")
    elif family.kind == "encoder":
        order = ("AutoModel", "AutoModelForMaskedLM")
    else:
        order = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForSeq2SeqLM", "AutoModel")
    for auto in order:  # a mapping of several classes (Funnel's AutoModel: FunnelModel, FunnelBaseModel) picks
        if len(built[auto]) == 1 or declared & built[auto]:  # by the declared one; without, a TypeError
            return getattr(transformers, auto)
    return next((getattr(transformers, a) for a in order if built[a]), transformers.AutoModelForCausalLM)


def _names(entry: Any) -> set[str]:
    if entry is None:
        return set()
    return {entry} if isinstance(entry, str) else set(entry)
