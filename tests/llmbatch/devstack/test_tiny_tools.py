"""The tiny tool model: its template renders tools, calls and results the Hermes way,
and vLLM's ``LLM.chat`` with ``tools`` and its ``hermes`` parser work on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmbatch.devstack.tiny_tools import TOOL_TAGS
from tests.fixtures.offline_llm import run_llm

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["London", "Paris", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the weather in Oslo?"},
]
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
}
ANSWERED: list[dict[str, Any]] = [
    *QUESTION,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tool_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tool_model_path)


def test_tools_go_in_the_system_turn(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(
        QUESTION, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|bos|><|system|>You are brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in prompt
    assert prompt.endswith(
        "</tool_call><|end|><|user|>What is the weather in Oslo?<|end|><|assistant|>"
    )


def test_without_tools_it_renders_as_the_tiny_llama(tokenizer: Any, tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_model_path)
    for messages in (QUESTION, QUESTION[1:]):
        assert tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        ) == plain.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_calls_and_results_render_hermes_style(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(
        ANSWERED, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith(
        "<|assistant|><tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
        "</tool_call><|end|>"
        '<|tool|><tool_response>\n{"temperature": 3}\n</tool_response><|end|><|assistant|>'
    )
    # vLLM hands the template arguments as a dict (it parses the JSON string first).
    as_dict = [
        *ANSWERED[:2],
        {
            **ANSWERED[2],
            "tool_calls": [
                {
                    **CALL,
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Oslo", "unit": "celsius"},
                    },
                }
            ],
        },
        ANSWERED[3],
    ]
    assert (
        tokenizer.apply_chat_template(
            as_dict, tools=[WEATHER], add_generation_prompt=True, tokenize=False
        )
        == prompt
    )


def test_tool_tags_are_single_tokens_that_decoding_keeps(tokenizer: Any) -> None:
    for tag in TOOL_TAGS:
        (token,) = tokenizer.encode(tag, add_special_tokens=False)
        assert tokenizer.decode([token], skip_special_tokens=True) == tag


@pytest.mark.slow
def test_vllm_chats_with_tools_and_its_hermes_parser_reads_the_calls(
    tiny_tool_model_path: Path, tmp_path: Path
) -> None:
    script = """
from vllm.sampling_params import StructuredOutputsParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
model, question, answered, tool = sys.argv[1], *map(json.loads, sys.argv[2:5])
# As llm-batch's engine sets it: compact JSON, or a random model fills any allowed
# whitespace and never closes the object.
llm = load(model, structured_outputs_config={"backend": "xgrammar",
                                             "disable_any_whitespace": True})
function = tool["function"]
# What a named tool choice asks of vLLM: output that fits the call's schema.
call_schema = {"type": "object", "required": ["name", "arguments"],
               "additionalProperties": False,
               "properties": {"name": {"const": function["name"]},
                              "arguments": function["parameters"]}}
named = SamplingParams(max_tokens=200, temperature=0,
                       structured_outputs=StructuredOutputsParams(json=call_schema))
free = SamplingParams(max_tokens=8, temperature=0)
called = llm.chat(question, named, tools=[tool], use_tqdm=False)[0]
after = llm.chat(answered, free, tools=[tool], use_tqdm=False)[0]
text = "<tool_call>\\n" + called.outputs[0].text + "\\n</tool_call>"
parser = Hermes2ProToolParser(llm.get_tokenizer())
request = ChatCompletionRequest(model=model, messages=question, tools=[tool])
extracted = parser.extract_tool_calls(text, request)
done(prompt=called.prompt, call_text=called.outputs[0].text,
     after_prompt=after.prompt, after_text=after.outputs[0].text,
     tools_called=extracted.tools_called,
     calls=[{"name": c.function.name, "arguments": c.function.arguments}
            for c in extracted.tool_calls])
"""
    result = run_llm(
        script,
        str(tiny_tool_model_path),
        json.dumps(QUESTION),
        json.dumps(ANSWERED),
        json.dumps(WEATHER),
        log=tmp_path / "tiny-tools.log",
    )
    assert '"name": "get_weather"' in result["prompt"] and "<tools>" in result["prompt"]
    call = json.loads(result["call_text"])
    assert call["name"] == "get_weather"
    assert call["arguments"]["city"] in ("London", "Paris", "Oslo")
    assert result["tools_called"] and len(result["calls"]) == 1
    assert result["calls"][0]["name"] == "get_weather"
    assert json.loads(result["calls"][0]["arguments"]) == call["arguments"]
    # The conversation goes on after the tool's result, rendered as the template says.
    assert result["after_prompt"].endswith("</tool_response><|end|><|assistant|>")
    assert result["after_text"].strip()
