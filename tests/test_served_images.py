"""compare's image route (posdiag/ports/served/images.py) against a canned chat API that answers as vLLM does
(`prompt_token_ids`, `prompt_logprobs` by token id, generated `token_ids` with their log-probs), its side run by
transformers on the tiny Qwen2-VL of tests/vlm_checkpoint.py: it decodes the PNGs it is sent, lays each image out by
its grid, scores the prompt and generates greedily after it. Healthy it PASSes; numbering the second image at the
first image's positions FAILs from the second image's first token, numbering the tokens decoded after the prompt by
their index from the first of them; a layout other than the reference processor's, a refusal, a reply without ids
are not judged (SKIP, saying why); a server error FAILs the route. tests/test_served_vllm_images.py runs the same
against the real vLLM."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
import torch
from canned_server import canned_server
from vlm_checkpoint import tiny_qwen2_vl

from posdiag.errors import PosdiagError
from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served
from posdiag.ports.served import compare_served, images
from posdiag.results import Status

IMAGE = 255  # tests/vlm_checkpoint.SPECIAL's <|image_pad|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_subject(str(model_dir))


@pytest.fixture(scope="module")
def served_model(model_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def _pixels(url: str) -> torch.Tensor:
    """The [H, W, 3] pixels of posdiag's PNG (one IDAT, filter 0 on every row)."""
    data = base64.b64decode(url.split(",", 1)[1])
    width, height = struct.unpack(">II", data[16:24])
    at, idat = 8, b""
    while at < len(data):
        size = struct.unpack(">I", data[at:at + 4])[0]
        if data[at + 4:at + 8] == b"IDAT":
            idat += data[at + 8:at + 8 + size]
        at += 12 + size
    rows = torch.frombuffer(bytearray(zlib.decompress(idat)), dtype=torch.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()
    return rows[:, 1:].reshape(height, width, 3).double()


def server(served_model, plant=None, status=None, wider=False, ids=True):
    """A chat API as vLLM's, generating greedily after the prompt: PLANT 'second image' numbers the second image at
    the first image's positions, 'delta' numbers the tokens it decodes by their index (the positions the images saved
    forgotten); WIDER makes each image 28 pixels wider first (a processor that resizes: more tokens); STATUS answers
    with that HTTP status; IDS False leaves the token ids out."""
    from posdiag.model.multimodal_pixels import patchified, patching

    tokenizer, model = served_model

    def answer(method, path, body, headers):
        if method == "GET":
            return 200, {"data": [{"id": "tiny"}]}, {}
        if status:
            return status, {"error": {"message": "no images here"}}, {}
        parts = body["messages"][0]["content"]
        pictures = [_pixels(p["image_url"]["url"]) for p in parts if p["type"] == "image_url"]
        pictures = [torch.cat([p, p[:, :28]], dim=1) for p in pictures] if wider else pictures
        pixels, grids, _ = patchified(pictures, patching(model.config.vision_config), "qwen2_vl")
        text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        laid, grid = [], iter(grids.tolist())
        for tid in tokenizer(text)["input_ids"]:
            if tid == IMAGE:
                t, h, w = next(grid)
                laid += [IMAGE] * (t * h * w // 4)
            else:
                laid.append(tid)

        def log_probs(sequence):
            ids = torch.tensor([sequence])
            kinds = (ids == IMAGE).long()
            with torch.no_grad():
                positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids)
                (a, b), (c, _) = images.spans(laid, IMAGE)[:2]
                if plant == "second image":
                    positions[:, :, c:c + b - a + 1] = positions[:, :, a:b + 1]
                if plant == "delta":
                    positions[:, :, len(laid):] = torch.arange(len(laid), len(sequence))
                return model(input_ids=ids, pixel_values=pixels.float(), image_grid_thw=grids,
                             mm_token_type_ids=kinds, position_ids=positions).logits[0].log_softmax(-1)

        k, generated, content = body["prompt_logprobs"], [], []
        for _ in range(body["max_tokens"]):
            row = log_probs(laid + generated)[-1]
            top = row.topk(k)
            generated.append(int(top.indices[0]))
            content.append({"token": tokenizer.decode([generated[-1]]), "logprob": float(top.values[0]),
                            "top_logprobs": [{"token": tokenizer.decode([int(i)]), "logprob": float(v)}
                                             for v, i in zip(top.values, top.indices, strict=True)]})
        lp = log_probs(laid)
        scored = [None]
        for t in range(1, len(laid)):
            top = lp[t - 1].topk(k)
            entry = {str(i): {"logprob": float(v), "rank": r + 1} for r, (v, i) in
                     enumerate(zip(top.values, top.indices.tolist(), strict=True))}
            entry[str(laid[t])] = {"logprob": float(lp[t - 1, laid[t]]), "rank": 0}
            scored.append(entry)
        choice = {"message": {"content": "x"}, "logprobs": {"content": content}, "finish_reason": "length"}
        if not ids:
            return 200, {"choices": [choice], "prompt_logprobs": scored}, {}
        return 200, {"choices": [{**choice, "token_ids": generated}], "prompt_token_ids": laid,
                     "prompt_logprobs": scored}, {}

    return canned_server(answer)


def _route(reference, base):
    result = compare_served(reference, open_served(base), route="images").result
    return result, result.details["routes"]["images"]


def test_healthy_images_pass_at_every_prompt_position(reference, served_model):
    with server(served_model) as base:
        result, route = _route(reference, base)
    assert result.status is Status.PASS, result.summary
    assert route["premise"]["confirmed"] and route["positions"] == route["tokens"] - 1 + route["generated"]
    assert [b - a + 1 for a, b in route["image_positions"]] == [6, 6]
    assert "laid out 2 images as 6 and 6 placeholder tokens" in result.summary
    assert f"8 tokens decoded after it, from position {route['tokens']}" in result.summary


def test_a_served_dtype_joins_the_floor_of_the_image_route(reference, served_model):
    """--served-dtype bfloat16: the reference run with its weights in bfloat16 on the same pixels joins the floor."""
    with server(served_model) as base:
        plain = _route(reference, base)[1]
        result = compare_served(reference, open_served(base), route="images", served_dtype="bfloat16").result
    route = result.details["routes"]["images"]
    assert result.status is Status.PASS, result.summary
    assert "the reference at bfloat16" in result.details["floor_source"]
    assert route["noise_floor_median"] > 100 * plain["noise_floor_median"]  # bfloat16's rounding, not float32's
    assert next(reference.model.parameters()).dtype == torch.float32  # held for the floor only, restored


def test_decoded_tokens_numbered_by_their_index_fail_from_the_first_decoded_position(reference, served_model):
    with server(served_model, plant="delta") as base:
        result, route = _route(reference, base)
    assert result.status is Status.FAIL, result.summary
    assert route["onset_position"] == route["decoded_from"] == route["tokens"] and route["generated"] == 8
    assert f"position {route['decoded_from']}, the first position decoded after the prompt" in result.summary


def test_second_image_at_the_first_images_positions_fails_from_the_second_image(reference, served_model):
    with server(served_model, plant="second image") as base:
        result, route = _route(reference, base)
    second = route["image_positions"][1][0]
    assert result.status is Status.FAIL, result.summary
    assert route["onset_position"] == second
    assert f"position {second}, image 2's first token" in result.summary
    assert route["worst_ratio"] > 100  # not near the tolerance


def test_a_layout_other_than_the_references_is_not_judged(reference, served_model):
    with server(served_model, plant="second image", wider=True) as base:
        result, route = _route(reference, base)
    assert result.status is Status.SKIP and route["status"] == "skip"  # not judged, though a bug is planted
    assert "(8, 9 tokens at positions" in route["why"] and "it saw other pixels" in route["why"], route["why"]


@pytest.mark.parametrize(("status", "verdict", "words"), [(400, Status.SKIP, "the server does not take it"),
                                                         (500, Status.FAIL, "the server failed on it")])
def test_a_refusal_is_not_run_and_a_server_error_fails(reference, served_model, status, verdict, words):
    with server(served_model, status=status) as base:
        result, route = _route(reference, base)
    assert result.status is verdict and words in route["why"] and "HTTP " + str(status) in route["why"]


def test_a_reply_without_token_ids_is_not_judged(reference, served_model):
    with server(served_model, ids=False) as base:
        result, route = _route(reference, base)
    assert result.status is Status.SKIP and "return_token_ids" in route["why"]


def test_images_are_refused_in_one_line_for_a_reference_without_images(served_model):
    from pathlib import Path

    text_only = load_subject(str(Path(__file__).parents[1] / "fixtures" / "llama-tiny"))
    with server(served_model) as base, pytest.raises(PosdiagError, match="--route images: the reference takes no "):
        compare_served(text_only, open_served(base), route="images")


def test_png_holds_the_very_pixels():
    from posdiag.model.multimodal_pixels import still_image

    image = still_image(56, 84, 1)
    url = "data:image/png;base64," + base64.b64encode(images.png(image)).decode()
    assert torch.equal(_pixels(url), image)
