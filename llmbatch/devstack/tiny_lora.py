"""A tiny LoRA adapter for the tiny Llama (:mod:`~llmbatch.devstack.tiny_model`), for
per-request adapters (vLLM's ``LoRARequest``, ``--lora-modules``).

Made with peft, random in both of its matrices: peft's default starts B at zero,
which would make the adapter answer exactly as the base model, and a test could not
tell them apart. Built once per recipe hash (:mod:`~llmbatch.devstack.model_cache`);
the recipe holds the base model's weights hash, so an adapter is rebuilt with its
base. Needs peft (the ``dev`` extra).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from llmbatch.devstack import tiny_model
from llmbatch.devstack.model_cache import build_once

# Bump when the code below changes what is written for the same recipe.
VERSION = 1

RANK = 8
ALPHA = 16
# Attention projections only: what most published adapters touch.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_tiny_lora(path: Path, *, base: Path, seed: int = 1) -> Path:
    """Build a LoRA adapter for the tiny Llama at ``base`` into ``path`` once; return
    ``path``.

    Rank :data:`RANK` on the attention projections; another ``seed`` gives another
    adapter (another answer to the same prompt). vLLM serves it with
    ``enable_lora=True`` and ``max_lora_rank`` of at least :data:`RANK`.
    """
    base = Path(base)
    recipe = {
        "kind": "tiny-lora",
        "version": VERSION,
        "seed": seed,
        "rank": RANK,
        "alpha": ALPHA,
        "target_modules": list(TARGET_MODULES),
        "base_weights_sha256": _weights_hash(base),
    }
    return build_once(path, recipe, lambda folder: _write_lora(folder, base, seed))


def _weights_hash(base: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((base / name).read_bytes())
    return digest.hexdigest()


def _write_lora(folder: Path, base: Path, seed: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model: Any = LlamaForCausalLM.from_pretrained(base, dtype="float32")
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        # Both matrices keep nn.Linear's random start (B is not zeroed).
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    with tiny_model.seeded(seed):
        adapter: Any = get_peft_model(model, config)
    adapter.save_pretrained(folder, safe_serialization=True)
    # peft's model card names the machine's base path and peft's version: noise here.
    (folder / "README.md").unlink(missing_ok=True)
