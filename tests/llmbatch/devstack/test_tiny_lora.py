"""The tiny LoRA adapters: what peft wrote, and that vLLM serves them beside the base
model, each request answered by its own adapter as transformers + peft answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmbatch.devstack.tiny_lora import RANK, TARGET_MODULES, build_tiny_lora
from tests.fixtures.offline_llm import run_llm

PROMPT = "<|bos|><|user|>Write about the weather.<|end|><|assistant|>"
MAX_TOKENS = 8


def test_adapters_are_peft_lora_folders(
    tiny_lora_paths: tuple[Path, Path], tiny_model_path: Path
) -> None:
    first, second = tiny_lora_paths
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    assert sorted(config["target_modules"]) == sorted(TARGET_MODULES)
    assert (first / "adapter_model.safetensors").read_bytes() != (
        second / "adapter_model.safetensors"
    ).read_bytes()
    # Built once: asking again rewrites nothing.
    stamp = (first / "adapter_model.safetensors").stat().st_mtime_ns
    assert build_tiny_lora(first, base=tiny_model_path, seed=1) == first
    assert (first / "adapter_model.safetensors").stat().st_mtime_ns == stamp


def peft_greedy(base: Path, adapter: Path | None) -> list[int]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer: Any = AutoTokenizer.from_pretrained(base)
    model: Any = LlamaForCausalLM.from_pretrained(base, dtype="float32")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    ids = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
    return [int(x) for x in out[0, ids.shape[1] :]]


LORA_SCRIPT = f"""
from vllm.lora.request import LoRARequest
model, first, second = sys.argv[1:4]
llm = load(model, enable_lora=True, max_loras=2, max_lora_rank={RANK})
params = SamplingParams(max_tokens={MAX_TOKENS}, temperature=0, ignore_eos=True)
prompt = {PROMPT!r}
adapters = {{"first": LoRARequest("first", 1, first), "second": LoRARequest("second", 2, second)}}
result = {{}}
for batch in json.loads(sys.argv[4]):
    outputs = llm.generate([prompt] * len(batch), params, use_tqdm=False,
                           lora_request=[adapters.get(name) for name in batch])
    result[" ".join(map(str, batch))] = [list(o.outputs[0].token_ids) for o in outputs]
done(**result)
"""


def run_batches(
    base: Path, adapters: tuple[Path, Path], batches: list[list[str | None]], log: Path
) -> dict[str, list[list[int]]]:
    """vLLM's answers to PROMPT for each batch of adapter names (None: the base model),
    all batches on one engine, keyed by the batch's names."""
    first, second = adapters
    found = run_llm(LORA_SCRIPT, str(base), str(first), str(second), json.dumps(batches), log=log)
    return {key: value for key, value in found.items() if not key.endswith("_s")}


@pytest.mark.slow
def test_vllm_serves_each_request_with_its_adapter(
    tiny_model_path: Path, tiny_lora_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    answers = run_batches(
        tiny_model_path,
        tiny_lora_paths,
        [[None], ["first", "second", "first"]],
        tmp_path / "tiny-lora.log",
    )
    (base_ids,) = answers["None"]
    first_ids, second_ids, first_again = answers["first second first"]
    assert len({tuple(base_ids), tuple(first_ids), tuple(second_ids)}) == 3
    assert first_again == first_ids
    # Each answer is what transformers with peft gives for that adapter.
    first, second = tiny_lora_paths
    assert base_ids == peft_greedy(tiny_model_path, None)
    assert first_ids == peft_greedy(tiny_model_path, first)
    assert second_ids == peft_greedy(tiny_model_path, second)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32's CPU LoRA ops index adapters with the no-adapter id -1 as a "
    "Python index, so a base-model request batched with adapter requests gets the "
    "last adapter slot's delta when that slot holds one (open upstream: "
    "vllm-project/vllm PRs 48421, 49656)",
)
def test_vllm_cpu_answers_the_base_model_beside_adapters(
    tiny_model_path: Path, tiny_lora_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    answers = run_batches(
        tiny_model_path,
        tiny_lora_paths,
        # Both adapter slots taken, so the last one holds an adapter.
        [[None, "first", "second"]],
        tmp_path / "tiny-lora-mixed.log",
    )
    base_ids, first_ids, second_ids = answers["None first second"]
    assert first_ids == peft_greedy(tiny_model_path, tiny_lora_paths[0])
    assert second_ids == peft_greedy(tiny_model_path, tiny_lora_paths[1])
    assert base_ids == peft_greedy(tiny_model_path, None)
