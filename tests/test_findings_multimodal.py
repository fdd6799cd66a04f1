"""Upstream findings on multimodal prompts (benchmarks/sweep.py FINDINGS, keys `<type>:<variant>`), reproduced in plain
transformers with the prompt posdiag builds (two images between text, a 4-frame video): no posdiag check involved.
Each asks the findings table whether it holds on the installed transformers; where upstream fixed it, the two
computations must agree."""

from __future__ import annotations

import warnings

import plants_multimodal as plants
import pytest
import torch
import transformers
from sweep_support import sweep_module

from posdiag.model.caches import cache_keyword
from posdiag.model.multimodal_inputs import build_prompt

BUG, TWIN_MARGIN = 1e-6, 1e3


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")


def finding(key: str, check: str):
    return sweep_module().finding(key, check)


def _text_after_video(model) -> tuple[int, int]:
    """(first position of the text after the video, the video's largest temporal position) as get_rope_index
    numbers posdiag's prompt."""
    prompt, why = build_prompt(model, 0)
    assert why == ""
    video = next(s for s in prompt.spans if s.kind == "video")
    pos = prompt.numbering()
    return int(pos[0, video.stop]), int(pos[0, video.start:video.stop].max())


def test_text_after_a_video_overlaps_it():
    """Qwen2.5-VL at its config default of 4 temporal positions per second: the video (0.5 s per temporal patch) takes
    t = 19 and 21; 5.25 resumes the text at 19 + max(h, w) = 21, the video's own last temporal position. The twin at
    2 positions per second (t = 19, 20) resumes past it."""
    text, video_end = _text_after_video(plants.video_overlap())
    assert (text <= video_end) == (finding("qwen2_5_vl", "positions") is not None), (text, video_end)
    text, video_end = _text_after_video(plants.healthy("qwen2_5_vl", tokens_per_second=2))
    assert text == video_end + 1


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """The logits of ids[prefill:] decoded one token at a time after a prefill, as a hand-written loop does: the
    cache passed, no position_ids."""
    cache = transformers.DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    with torch.inference_mode():
        model(input_ids=ids[:, :prefill], **{keyword: cache}, use_cache=True)
        steps = [model(input_ids=ids[:, t:t + 1], **{keyword: cache}, use_cache=True).logits[0, -1]
                 for t in range(prefill, ids.shape[1])]
    return torch.stack(steps)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_text_after_an_image_decodes_with_stale_rope_deltas(model_type):
    """Stock Qwen2-VL, Qwen2.5-VL and Qwen3-VL (float64): a text prompt decoded in a plain loop after an image prompt
    ran differs from the same loop on a fresh model; the image prompt's rope_deltas (-5) stay on the model and number
    the text's decode steps (position 3 where the fresh model uses 8). After a two-row batch holding the image prompt,
    the same one-row loop crashes (the two rows' deltas repeated 1 // 2 = 0 times). The twin: the same loop after
    another text prompt."""
    model = plants.healthy(model_type).to(torch.float64)
    text = torch.randint(4, 200, (1, 10), generator=torch.Generator().manual_seed(3))
    other = torch.randint(4, 200, (1, 10), generator=torch.Generator().manual_seed(4))
    fresh = _decode(model, text, 8)
    _decode(model, other, 8)
    twin = _rel(_decode(model, text, 8), fresh)
    prompt, _ = build_prompt(model, 0, video=False)
    with torch.inference_mode():
        model(**prompt.inputs(), use_cache=True)
    assert int(model.model.rope_deltas) == -5
    bug = _rel(_decode(model, text, 8), fresh)
    differs = bug > BUG and bug > TWIN_MARGIN * twin
    holds = finding(model_type, "state") is not None
    assert differs == holds, (bug, twin)
    inputs = prompt.inputs(torch.cat([prompt.ids, prompt.ids]))
    inputs["mm_token_type_ids"] = torch.cat([prompt.kinds, prompt.kinds])
    inputs["pixel_values"], inputs["image_grid_thw"] = (torch.cat([inputs[k], inputs[k]]) for k in
                                                        ("pixel_values", "image_grid_thw"))
    with torch.inference_mode():
        model(**inputs)
    try:
        broken = _rel(_decode(model, text, 8), fresh) > BUG
    except RuntimeError as exc:
        broken = "must match" in str(exc)
    assert broken == holds


def _masked_loop(model, ids: torch.Tensor, prefill: int, mask: bool) -> torch.Tensor:
    """`_decode`, each forward given the 2D mask of every token so far (as attention models take it) or none."""
    cache = transformers.DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    masks = (lambda t: {"attention_mask": torch.ones_like(ids[:, :t])}) if mask else (lambda t: {})
    with torch.inference_mode():
        model(input_ids=ids[:, :prefill], **{keyword: cache}, use_cache=True, **masks(prefill))
        steps = [model(input_ids=ids[:, t:t + 1], **{keyword: cache}, use_cache=True, **masks(t + 1)).logits[0, -1]
                 for t in range(prefill, ids.shape[1])]
    return torch.stack(steps)


@pytest.mark.parametrize("model_type", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_a_decode_step_given_the_whole_mask_crashes_the_omni_thinkers(model_type):
    """The Qwen2.5-Omni and Qwen3-Omni thinkers (the sweep's tiny models, float64) set rope_deltas on every prefill, a
    text prompt's too (0), so a cached step without position_ids takes compute_3d_position_ids' decoding branch, which
    numbers every token of the 2D mask (its cumsum over the cache and the new token) instead of the new token: the
    one-token step rotates its query into 9 and the mask built for one does not fit (RuntimeError). Not history: a
    fresh model crashes on its first step. Twins: the same loop without the mask equals the full forward, and
    Qwen2-VL, whose text prompt sets no rope_deltas, runs the loop with the mask."""
    from posdiag.testing.multimodal import small_model

    model = small_model(model_type).to(torch.float64).eval()
    if callable(getattr(model, "set_experts_implementation", None)):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    text = torch.randint(4, 200, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(input_ids=text).logits[0, 8:]
    assert _rel(_masked_loop(model, text, 8, mask=False), full) < BUG
    holds = finding(model_type, "serving") is not None
    try:
        crashed = _rel(_masked_loop(model, text, 8, mask=True), full) > BUG
    except RuntimeError as exc:
        crashed = "must match the size of tensor b" in str(exc)
    assert crashed == holds
    twin = small_model("qwen2_vl").to(torch.float64).eval()
    with torch.inference_mode():
        reference = twin(input_ids=text).logits[0, 8:]
    assert _rel(_masked_loop(twin, text, 8, mask=True), reference) < BUG


def test_glm4v_crashes_on_images_and_a_video_together():
    """GLM-4V's processor writes a video's frames as image tokens (mm_token_type_ids 2, between video delimiters); the
    forward's placeholder check counts every image token against the still images' features, so posdiag's prompt of
    two images and a video raises ValueError. Twins: the images alone and the video alone run."""
    model = plants.healthy("glm4v")
    parts = [build_prompt(model, 0, **kw)[0] for kw in ({}, {"video": False}, {"images": False})]
    assert [p.contents for p in parts] == ["2 images and a 4-frame video", "2 images", "a 4-frame video"]
    holds = finding("glm4v", "positions") is not None
    try:
        with torch.inference_mode():
            model(**parts[0].inputs())
        crashed = False
    except ValueError as exc:
        crashed = "Image features and image tokens do not match" in str(exc)
    assert crashed == holds
    with torch.inference_mode():
        for part in parts[1:]:
            assert torch.isfinite(model(**part.inputs()).logits).all()
