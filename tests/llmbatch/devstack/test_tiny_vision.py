"""The tiny image models: what their processors make of an image, and that vLLM runs
them (the vision-language model answering about images, CLIP embedding them)."""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from llmbatch.devstack.model_cache import MARKER
from llmbatch.devstack.tiny_vision import (
    CLIP_PROJECTION_DIM,
    IMAGE_SEQ_LEN,
    IMAGE_TOKEN,
    build_tiny_vlm,
)
from tests.fixtures.offline_llm import run_llm


def picture(colour: str, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A generated test image: a coloured disc on a grey field."""
    image = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(image).ellipse((4, 4, size[0] - 4, size[1] - 4), fill=colour)
    return image


def save(image: Image.Image, path: Path) -> str:
    image.save(path, format="PNG")
    return str(path)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_builds_are_cached_by_recipe(tmp_path: Path, tiny_vlm_path: Path) -> None:
    again = build_tiny_vlm(tiny_vlm_path)
    assert again == tiny_vlm_path
    other = build_tiny_vlm(tmp_path / "vlm-seed-1", seed=1)
    assert (other / MARKER).read_text() != (tiny_vlm_path / MARKER).read_text()
    assert (other / "model.safetensors").read_bytes() != (
        tiny_vlm_path / "model.safetensors"
    ).read_bytes()


def test_vlm_processor_puts_the_image_where_the_message_has_it(tiny_vlm_path: Path) -> None:
    from transformers import AutoProcessor

    processor: Any = AutoProcessor.from_pretrained(tiny_vlm_path)
    # The PIL image processor: no torchvision on the CPU setup.
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image"},
                {"type": "text", "text": " Answer briefly."},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>What is this?<image> Answer briefly.<|end|><|assistant|>"
    tokenizer = processor.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    # Any image is resized to a 64-pixel longest edge and split in 2x2 tiles of 32,
    # plus the whole image once more: 5 tiles.
    for size in ((30, 20), (48, 40), (300, 200)):
        out = processor(text=[prompt], images=[[picture("red", size)]])
        ids = list(out["input_ids"][0])
        assert ids.count(image_id) == 5 * IMAGE_SEQ_LEN
    assert "<row_2_col_2>" in tokenizer.decode(ids)


@pytest.mark.slow
def test_vlm_answers_about_images_in_vllm(tiny_vlm_path: Path, tmp_path: Path) -> None:
    red, blue = picture("red"), picture("blue")
    script = """
from PIL import Image
model, red_path, blue_path, red_url = sys.argv[1:5]
red, blue = Image.open(red_path).convert("RGB"), Image.open(blue_path).convert("RGB")
llm = load(model, limit_mm_per_prompt={"image": 2})
params = SamplingParams(max_tokens=8, temperature=0)
prompt = "<|bos|><|user|>Describe<image><|end|><|assistant|>"
by_input = llm.generate(
    [{"prompt": prompt, "multi_modal_data": {"image": red}},
     {"prompt": prompt, "multi_modal_data": {"image": blue}},
     {"prompt": "<|bos|><|user|>Describe<|end|><|assistant|>"}],
    params, use_tqdm=False)
by_chat = llm.chat(
    [{"role": "user", "content": [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": red_url}}]}],
    params, use_tqdm=False)
two = llm.chat(
    [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": red_url}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": red_url}}]}],
    params, use_tqdm=False)
done(
    texts=[o.outputs[0].text for o in by_input],
    token_ids=[list(o.outputs[0].token_ids) for o in by_input],
    prompt_lens=[len(o.prompt_token_ids) for o in by_input],
    chat_prompt=by_chat[0].prompt,
    chat_token_ids=list(by_chat[0].outputs[0].token_ids),
    two_prompt_len=len(two[0].prompt_token_ids),
)
"""
    result = run_llm(
        script,
        str(tiny_vlm_path),
        save(red, tmp_path / "red.png"),
        save(blue, tmp_path / "blue.png"),
        data_url(red),
        log=tmp_path / "tiny-vlm.log",
    )
    red_ids, blue_ids, text_ids = result["token_ids"]
    assert all(len(ids) == 8 for ids in result["token_ids"])
    assert all(text.strip() and "<" not in text for text in result["texts"])
    # The image reaches the model: another picture, another answer, and its tokens
    # are in the prompt (48x40 is split in 2x2 tiles plus the whole image).
    assert red_ids != blue_ids and red_ids != text_ids
    with_image, _, without = result["prompt_lens"]
    assert with_image - without >= 5 * IMAGE_SEQ_LEN
    # The chat path (an image_url data URL part) renders the same prompt and answer.
    assert result["chat_prompt"] == "<|bos|><|user|>Describe<image><|end|><|assistant|>"
    assert result["chat_token_ids"] == red_ids
    assert result["two_prompt_len"] > 2 * 5 * IMAGE_SEQ_LEN


def test_clip_tokenizer_wraps_text_for_its_pooling(tiny_clip_path: Path) -> None:
    from transformers import AutoProcessor

    processor: Any = AutoProcessor.from_pretrained(tiny_clip_path)
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    tokenizer = processor.tokenizer
    ids = tokenizer("a dog by the fire").input_ids
    # Start and end of text around it; the text tower pools at the end token.
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    # vLLM's CLIP processing puts image positions on token 0: it must be ordinary.
    assert 0 not in tokenizer.all_special_ids


@pytest.mark.slow
def test_clip_embeds_images_and_texts_in_vllm(tiny_clip_path: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoProcessor, CLIPModel

    images = [picture("red"), picture("green", (40, 40)), picture("blue", (20, 36))]
    texts = ["a red disc", "the quick brown fox jumps over the lazy dog"]
    script = """
from PIL import Image
model, texts = sys.argv[1], json.loads(sys.argv[2])
images = [Image.open(p).convert("RGB") for p in sys.argv[3:]]
llm = load(model, runner="pooling", max_model_len=77, limit_mm_per_prompt={"image": 1})
by_image = llm.embed([{"prompt": "", "multi_modal_data": {"image": im}} for im in images],
                     use_tqdm=False)
by_text = llm.embed(texts, use_tqdm=False)
done(images=[o.outputs.embedding for o in by_image],
     texts=[o.outputs.embedding for o in by_text])
"""
    paths = [save(im, tmp_path / f"image-{i}.png") for i, im in enumerate(images)]
    result = run_llm(
        script, str(tiny_clip_path), json.dumps(texts), *paths, log=tmp_path / "tiny-clip.log"
    )
    assert len(result["images"]) == 3 and len(result["texts"]) == 2
    for vector in result["images"] + result["texts"]:
        assert len(vector) == CLIP_PROJECTION_DIM
        assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-4)

    # The same vectors as transformers' CLIPModel on the same inputs (normalised).
    processor: Any = AutoProcessor.from_pretrained(tiny_clip_path)
    model: Any = CLIPModel.from_pretrained(tiny_clip_path).eval()
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        image_features = model.get_image_features(pixel_values=pixels)
        tokens = processor.tokenizer(texts, return_tensors="pt", padding=True)
        text_features = model.get_text_features(**tokens)
    for features, got in ((image_features, result["images"]), (text_features, result["texts"])):
        features = getattr(features, "pooler_output", features)
        for expected, vector in zip(features.tolist(), got, strict=True):
            assert cosine(expected, vector) >= 0.9999
