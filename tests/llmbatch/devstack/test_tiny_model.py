"""The tiny offline model: deterministic, idempotent, and loadable by vLLM."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from llmbatch.contract.spec import SamplingSpec
from llmbatch.devstack.demo import INDUSTRIES
from llmbatch.devstack.model_cache import built_recipe
from llmbatch.devstack.tiny_model import MARKER, SPECIAL_TOKENS, build_tiny_model
from llmbatch.engine.requests import GenerationRequest
from llmbatch.engine.vllm_engine import Engine

WEIGHTS = "model.safetensors"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building must never need the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_builds_identical_bytes(tmp_path: Path) -> None:
    started = time.perf_counter()
    first = files(build_tiny_model(tmp_path / "one"))
    second = files(build_tiny_model(tmp_path / "two"))
    print(f"two tiny models built in {time.perf_counter() - started:.1f} s")
    for name in ("config.json", "generation_config.json", "tokenizer.json", WEIGHTS, MARKER):
        assert name in first, name
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between two builds"
    assert 1 << 20 < sum(map(len, first.values())) < 4 << 20  # about 2 MB


def test_another_seed_changes_only_the_weights(tmp_path: Path, tiny_model_path: Path) -> None:
    seed0, seed1 = files(tiny_model_path), files(build_tiny_model(tmp_path / "s1", seed=1))
    assert seed0[WEIGHTS] != seed1[WEIGHTS]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert seed0[name] == seed1[name], name


def test_a_built_folder_is_reused_and_an_unfinished_one_rebuilt(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m")
    stamp = (path / WEIGHTS).stat().st_mtime_ns
    assert build_tiny_model(path) == path
    assert (path / WEIGHTS).stat().st_mtime_ns == stamp  # nothing rewritten

    # Without its marker a folder counts as unfinished (a crash mid-build).
    (path / MARKER).unlink()
    (path / WEIGHTS).write_bytes(b"half")
    build_tiny_model(path)
    assert (path / WEIGHTS).read_bytes() == files(build_tiny_model(tmp_path / "ref"))[WEIGHTS]

    # Asking for another seed replaces the folder.
    build_tiny_model(path, seed=7)
    recipe = built_recipe(path)
    assert recipe is not None and recipe["seed"] == 7
    # Nothing is left beside it from staging.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "ref"]


def test_config_is_a_small_llama_with_head_size_64(tiny_model_path: Path) -> None:
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["head_dim"] == 64
    assert config["max_position_embeddings"] == 2048
    assert 1000 <= config["vocab_size"] <= 2048
    generation = json.loads((tiny_model_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_tokenizer_has_special_tokens_and_a_chat_template(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|end|>",
        "<|pad|>",
    )
    messages = [
        {"role": "system", "content": "Answer with the industry only."},
        {"role": "user", "content": "Atlas Legal Associates"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|bos|><|system|>Answer with the industry only.<|end|>"
        "<|user|>Atlas Legal Associates<|end|><|assistant|>"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert isinstance(without, str) and not without.endswith("<|assistant|>")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids) == prompt  # byte-level: lossless
    assert all(token in tokenizer.convert_ids_to_tokens(ids) for token in SPECIAL_TOKENS[1:5])
    # The corpus taught it the demo's words: after a space each is one token.
    for industry in INDUSTRIES:
        words = industry.split()
        assert len(tokenizer.encode(" " + industry, add_special_tokens=False)) == len(words)
    # Bytes it never saw still encode and decode.
    assert tokenizer.decode(tokenizer.encode("naïve 日本 🙂", add_special_tokens=False)) == (
        "naïve 日本 🙂"
    )


async def test_loads_in_vllm_and_writes_visible_text(engine: Engine, tiny_model_path: Path) -> None:
    assert engine.options.model == str(tiny_model_path)
    request = GenerationRequest(
        request_id="tiny-loads",
        messages=[{"role": "user", "content": "Write about the weather."}],
        sampling=SamplingSpec(max_tokens=12),
    )
    result = await engine.generate(request)
    assert result.error_class is None
    # Special tokens have zero embeddings, so greedy decoding never picks them (or EOS).
    assert result.text.strip() and "<|" not in result.text
    assert (result.completion_tokens, result.finish_reason) == (12, "length")
