"""What part of a composite checkpoint the checks drive: the language model, with text inputs; the towers next to
it (vision, audio, speech encoders, projectors) are named as not tested."""

from __future__ import annotations

from typing import Any

# Sub-configs of the towers posdiag does not test (the language model is what carries text positions).
_TOWERS = {"vision_config": "vision tower", "audio_config": "audio tower", "vision_tower_config": "vision tower",
           "speech_config": "speech tower"}


def is_multimodal(config: Any) -> bool:
    """A config holding a language model next to other towers (vision-language, audio-language)."""
    return bool(_towers(config))


def _towers(config: Any) -> list[str]:
    """The untested towers next to a language model: the known names, and any other sub-config (GraniteSpeech's
    encoder_config, VibeVoice-ASR's tokenizer encoders; read as text models, their tower's convolutions were taken
    for recurrent mixers of the language model). [] when the config is no composite with a text config."""
    from transformers import PretrainedConfig

    get = getattr(config, "get_text_config", None)
    text = get(decoder=True) if callable(get) else config
    if text is config:
        return []
    return sorted({_TOWERS.get(name, name)
                   for name, value in vars(config).items()
                   if value is not None and value is not text and name != "text_config"
                   and (name in _TOWERS or (name.endswith("_config") and isinstance(value, PretrainedConfig)))})


def language_config(config: Any) -> Any:
    """The config the checks read (sizes, RoPE, windows, layer types): a multimodal model's text config
    (the top config of Qwen2-VL, LLaVA, Gemma3... holds none of them), else the config itself."""
    return config.get_text_config(decoder=True) if is_multimodal(config) else config


def tested_tower(model: Any) -> str:
    """What the checks run on, for the report header: "" for a text model."""
    config = getattr(model, "config", None)
    towers = _towers(config) if config is not None else []
    return f"language model of {type(model).__name__}; {' and '.join(towers)} not tested" if towers else ""
