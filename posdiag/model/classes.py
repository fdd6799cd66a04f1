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
    text LM the model holds (a sub-model with an LM head that runs on input_ids alone: Llama4's language_model,
    BLIP's text_decoder, Kosmos-2's text_model, Pix2Struct's and VisionEncoderDecoder's decoder) is driven alone,
    and the header says so. A decoder that cross-attends to an encoder runs alone only where its layers skip the
    cross-attention without encoder states (BLIP, Pix2Struct, BERT, Whisper do): its self-attention, positions
    and head are the text path, the cross-attention is named as not tested. Where no such sub-model runs, the
    header says why the model is not drivable by text alone."""
    tested = tested_tower(model)
    subs = _sub_models(model)
    if not tested and not any(_has_head(sub) for _, sub in subs):
        return model, tested or _decoder_alone(model)
    error = _text_forward_error(model)
    if error is None:
        return model, tested or _decoder_alone(model)
    outer = type(model).__name__
    why = []
    for name, sub in subs:
        ran = _text_forward_error(sub, logits=True)
        if ran is None:
            untested = _untested(model, tested)
            if _cross_attends(sub):  # its layers skip the cross-attention without encoder states
                untested += f" and {name}'s cross-attention to its features"
            return sub.eval(), (f"text model {type(sub).__name__} ({name}) of {outer}, driven alone ({outer}.forward "
                                f"raised {error} on text inputs); {untested} not tested")
        why.append(f"{type(sub).__name__} ({name}) {ran[:100]}")
    reason = "; ".join(why) or "it holds no text model of its own"
    return model, (f"{tested + '; ' if tested else ''}not drivable by text alone: {outer}.forward raised {error}; "
                   f"{reason}")[:600]


def _sub_models(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The sub-models that embed token ids (their own input embeddings), outermost first."""
    from transformers import PreTrainedModel

    out: list[tuple[str, torch.nn.Module]] = []
    for name, sub in model.named_modules():
        if not name or not isinstance(sub, PreTrainedModel):
            continue
        try:
            embeds = sub.get_input_embeddings()
        except Exception:  # a sub-model with no input embeddings to get (a vision tower)
            continue
        if isinstance(embeds, torch.nn.Embedding):
            out.append((name, sub))
    return out


def _has_head(sub: torch.nn.Module) -> bool:
    try:
        return sub.get_output_embeddings() is not None
    except Exception:  # a sub-model whose head getter needs what it lacks
        return False


def _decoder_alone(model: torch.nn.Module) -> str:
    """The header of an encoder-decoder's decoder built alone (WhisperForCausalLM, BartForCausalLM: the config has
    encoder layers, the class sets is_encoder_decoder off and builds none): "" for any other model."""
    config = getattr(model, "config", None)
    if getattr(config, "encoder_layers", None) and getattr(config, "is_encoder_decoder", None) is False:
        return f"text decoder {type(model).__name__} alone; the encoder and the cross-attention to it not tested"
    return ""


def _untested(model: torch.nn.Module, tested: str) -> str:
    """The parts of the model the text model leaves out: its towers, or its encoder."""
    if tested:
        return tested.split("; ", 1)[1].removesuffix(" not tested")
    return "the encoder" if getattr(model.config, "is_encoder_decoder", False) else "the rest of the model"


def _cross_attends(sub: torch.nn.Module) -> bool:
    """Whether a decoder has cross-attention layers (config add_cross_attention, or cross-attention modules)."""
    config = getattr(sub, "config", None)
    if getattr(config, "add_cross_attention", False):
        return True
    parts = {name.rsplit(".", 1)[-1].lower() for name, _ in sub.named_modules()}
    return any("cross" in part or ("encoder" in part and "att" in part) for part in parts)


def _text_forward_error(model: torch.nn.Module, logits: bool = False) -> str | None:
    """Why a forward on two token ids fails (None: it runs; with `logits`, it must also give logits)."""
    ids = torch.tensor([[4, 5]], device=input_device(model))
    # an encoder-decoder on text is driven with decoder ids too (EncoderDecoderModel raises without them)
    decoder = {"decoder_input_ids": ids} if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else {}
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, output_hidden_states=True, return_dict=True, **decoder)
    except Exception as exc:
        return f"{type(exc).__name__}: {one_line(exc)}"[:160]
    if logits and getattr(out, "logits", None) is None:
        return "gives no logits (no LM head of its own)"
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
    encoder-decoders with their LM head (or their decoder's, where only a causal-LM class has one), decoders
    with theirs, then image-text-to-text, then the base model.
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
        # Whisper's only LM head in these mappings is its decoder alone (WhisperForCausalLM): the base model has no
        # head and its forward needs the audio features.
        order = ("AutoModelForSeq2SeqLM", "AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel")
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
