"""Tiny image models vLLM runs on CPU: a vision-language model that answers about
images, and an image (and text) embedding model for vLLM's pooling runner.

Random weights, as for the tiny Llama (:mod:`~llmbatch.devstack.tiny_model`), whose
tokenizer corpus, text sizes and seeding they share; built once per recipe hash
(:mod:`~llmbatch.devstack.model_cache`). Images are 32x32 pixels in 8x8 patches, so an
image costs a handful of tokens.

Why these architectures: vLLM 0.32 on CPU imports a model's module before it loads it,
and the LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Gemma 3 modules import
transformers' torchvision-only image processors (LLaVA through Pixtral's); the CPU
setup has no torchvision (PyPI's build is a CUDA one that fails to load on the CPU
torch, and no CPU build matches torch 2.13), so none of those load here. Idefics3
(SmolVLM's architecture: a SigLIP-style vision tower, pixel shuffle, a Llama) and CLIP
import without it and process images with transformers' PIL processors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmbatch.devstack import tiny_model
from llmbatch.devstack.model_cache import build_once

# Bump when the code below changes what is written for the same recipe.
VERSION = 1

IMAGE_SIZE = 32
PATCH_SIZE = 8
VISION_HIDDEN_SIZE = 64
VISION_HEADS = 2
VISION_LAYERS = 2
VISION_INTERMEDIATE_SIZE = 128

# Idefics3's processor tokens: each image becomes
# <fake_token_around_image><global-img><image>*n<fake_token_around_image>, after a
# <row_i_col_j> tile per IMAGE_SIZE square when an image is larger and split.
IMAGE_TOKEN = "<image>"
IMAGE_MARKERS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
GRID_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# Pixel shuffle by 2 makes (32/8)^2 = 16 patches into 4 image tokens a tile.
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# An image is resized to at most this longest edge, then split into IMAGE_SIZE tiles
# (at most 2x2 here) plus the whole image once more.
MAX_EDGE = 2 * IMAGE_SIZE

# The tiny Llama's template, with image parts where the message puts them: vLLM sees
# the template loop over content parts and hands it OpenAI-style parts.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's text tower has learned positions for this many tokens only.
CLIP_MAX_TOKENS = 77
CLIP_TEXT_HIDDEN_SIZE = 64
# vLLM's CLIP keeps text and image embeddings in one tensor this wide: at least the
# text tower's width.
CLIP_PROJECTION_DIM = 64


@dataclass(frozen=True, kw_only=True)
class TinyVlm:
    """The recipe of the tiny vision-language model."""

    seed: int = 0

    def recipe(self) -> dict[str, Any]:
        return {
            "kind": "tiny-idefics3",
            "version": VERSION,
            "llama": tiny_model.TinyLlama(
                seed=self.seed,
                extra_special_tokens=(IMAGE_TOKEN, *IMAGE_MARKERS, *GRID_TOKENS),
                chat_template=VLM_CHAT_TEMPLATE,
            ).recipe(),
            **_vision_sizes(),
            "scale_factor": SCALE_FACTOR,
            "max_edge": MAX_EDGE,
        }


@dataclass(frozen=True, kw_only=True)
class TinyClip:
    """The recipe of the tiny CLIP embedding model."""

    seed: int = 0

    def recipe(self) -> dict[str, Any]:
        return {
            "kind": "tiny-clip",
            "version": VERSION,
            **dataclasses.asdict(self),
            **_vision_sizes(),
            "text_hidden_size": CLIP_TEXT_HIDDEN_SIZE,
            "projection_dim": CLIP_PROJECTION_DIM,
            "max_tokens": CLIP_MAX_TOKENS,
            "corpus": tiny_model.TinyLlama().recipe()["corpus_sha256"],
        }


def build_tiny_vlm(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny vision-language model into ``path`` once; return ``path``.

    Architecture ``Idefics3ForConditionalGeneration`` (what SmolVLM ships as): a
    2-layer SigLIP-style vision tower on 32x32 tiles, a pixel-shuffle connector, and
    the tiny Llama with ``<image>`` and Idefics3's image markers as special tokens,
    whose chat template puts ``<image>`` where a message has an image part. Chosen over
    LLaVA and Qwen2-VL because vLLM's modules for those need torchvision, which the CPU
    setup cannot have (see the module's docstring). The processor is saved too (the
    PIL image processor, no torchvision), so vLLM's multimodal inputs and
    ``LLM.chat`` with ``image_url`` parts both work. Answers are random text.
    """
    spec = TinyVlm(seed=seed)
    return build_once(path, spec.recipe(), lambda folder: _write_vlm(folder, spec))


def build_tiny_clip(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny image and text embedding model into ``path`` once; return ``path``.

    Architecture ``CLIPModel``, which vLLM 0.32 runs on its pooling runner as an
    embedding model (``CLIPEmbeddingModel``) for images or texts, one or the other per
    input; chosen because it is the multimodal embedding architecture in vLLM's
    registry that needs neither torchvision nor remote code, with the simplest
    processor (PIL). Embeddings are ``CLIP_PROJECTION_DIM`` wide. A text prompt holds
    at most ``CLIP_MAX_TOKENS`` tokens; an image is embedded with an empty prompt.
    """
    spec = TinyClip(seed=seed)
    return build_once(path, spec.recipe(), lambda folder: _write_clip(folder, spec))


def _vision_sizes() -> dict[str, int]:
    return {
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "vision_hidden_size": VISION_HIDDEN_SIZE,
        "vision_heads": VISION_HEADS,
        "vision_layers": VISION_LAYERS,
        "vision_intermediate_size": VISION_INTERMEDIATE_SIZE,
    }


def _write_vlm(folder: Path, spec: TinyVlm) -> None:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    special = [*tiny_model.SPECIAL_TOKENS, IMAGE_TOKEN, *IMAGE_MARKERS, *GRID_TOKENS]
    tokenizer = tiny_model.train_tokenizer(special_tokens=special, chat_template=VLM_CHAT_TEMPLATE)
    vision = Idefics3VisionConfig(
        hidden_size=VISION_HIDDEN_SIZE,
        intermediate_size=VISION_INTERMEDIATE_SIZE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=tiny_model.llama_text_config(tokenizer).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with tiny_model.seeded(spec.seed):
        model: Any = Idefics3ForConditionalGeneration(config)
    model.eval()
    # The image token's embedding is replaced by the image's; the rest as the Llama.
    tiny_model.zero_special_embeddings(model, tokenizer, special)
    model.generation_config = tiny_model.generation_config(tokenizer)
    tiny_model.save_model(model, folder)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": MAX_EDGE}, max_image_size={"longest_edge": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)


def _write_clip(folder: Path, spec: TinyClip) -> None:
    from tokenizers.processors import TemplateProcessing
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPProcessor,
        CLIPTextConfig,
        CLIPVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = tiny_model.train_tokenizer(
        special_tokens=[CLIP_EOS, CLIP_BOS, CLIP_EOS], chat_template=None, specials_last=True
    )
    bos, eos = tokenizer.convert_tokens_to_ids([CLIP_BOS, CLIP_EOS])
    # CLIP's text tower pools at the end-of-text token: every prompt gets one.
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{CLIP_BOS} $A {CLIP_EOS}",
        pair=f"{CLIP_BOS} $A {CLIP_EOS} $B {CLIP_EOS}",
        special_tokens=[(CLIP_BOS, bos), (CLIP_EOS, eos)],
    )
    tokenizer.model_max_length = CLIP_MAX_TOKENS
    text = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_TEXT_HIDDEN_SIZE,
        intermediate_size=2 * CLIP_TEXT_HIDDEN_SIZE,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_TOKENS,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        projection_dim=CLIP_PROJECTION_DIM,
    )
    vision = CLIPVisionConfig(
        hidden_size=VISION_HIDDEN_SIZE,
        intermediate_size=VISION_INTERMEDIATE_SIZE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=CLIP_PROJECTION_DIM,
    )
    config = CLIPConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=CLIP_PROJECTION_DIM,
        dtype="float32",
    )
    with tiny_model.seeded(spec.seed):
        model: Any = CLIPModel(config)
    model.eval()
    tiny_model.save_model(model, folder)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        ),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(folder)
