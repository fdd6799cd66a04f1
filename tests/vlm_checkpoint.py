"""A tiny Qwen2-VL checkpoint a server can load as it is: weights, a character tokenizer with the family's special
tokens at the config's ids, a chat template that places each image part where it stands, and the image
processor's config. Built on CPU in under a second, never downloaded.

The text model's heads are 32 wide (4 of them, hidden 128): vLLM's CPU attention refuses posdiag's usual 16
("Unsupported CPU attention configuration: head_dim=16"), and the multimodal rotary sections follow the head
(8 + 4 + 4 of its 16 pairs)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = {"<|im_start|>": 248, "<|unk|>": 249, "<|im_end|>": 250, "<|endoftext|>": 251, "<|vision_end|>": 252,
           "<|vision_start|>": 253, "<|video_pad|>": 254, "<|image_pad|>": 255}
"""At the ids posdiag.testing.multimodal places Qwen2-VL's at the top of a 256-token vocabulary."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' or c.type == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
             "max_pixels": 28 * 28 * 64, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
             "do_normalize": True, "do_convert_rgb": True}
"""Qwen2-VL's processor at the tiny tower's patching; CLIP's normalisation, as the real one."""


def tiny_qwen2_vl(folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from posdiag.testing.multimodal import small_config

    config = small_config("qwen2_vl", image_tokens_in_vocab=True, hidden_size=128, intermediate_size=256)
    config.text_config.rope_parameters["mrope_section"] = [8, 4, 4]
    assert {config.image_token_id, config.vision_start_token_id, config.vision_end_token_id} <= set(SPECIAL.values())
    torch.manual_seed(seed)
    transformers.AutoModelForImageTextToText.from_config(config).eval().save_pretrained(folder)
    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(characters)}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(characters), min(SPECIAL.values()))})
    vocab.update(SPECIAL)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token a character
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                         unk_token="<|unk|>", chat_template=CHAT_TEMPLATE,
                                         model_max_length=256).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return folder
