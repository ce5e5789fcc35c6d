"""The tiny Llama with a tool-calling chat template, for ``tools`` requests.

The template is Hermes-style (what Hermes 2 Pro, Qwen 2.5 and many fine-tunes use):
the tools' JSON schemas go in the system turn inside ``<tools></tools>``, an assistant
turn's calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and a tool
result is ``<tool_response>...</tool_response>``, so vLLM's own ``hermes`` tool parser
(``--tool-call-parser hermes``) reads the model's calls. ``<tool_call>`` and the other
tags are single tokens, not special ones: decoding keeps them for the parser (as in
Qwen 2.5's tokenizer). Their embeddings are zero, like the chat markers', so the
random model never writes one by itself: a test that needs a call asks for it (a named
or ``required`` tool choice, which vLLM turns into structured output).
"""

from __future__ import annotations

from pathlib import Path

from llmbatch.devstack import tiny_model

TOOL_ROLE = "<|tool|>"
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Newlines right after a block tag are written as {{ '\n' }}: transformers renders chat
# templates with trim_blocks, which drops them.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set rest = messages[1:] if messages and messages[0]['role'] == 'system' "
    "else messages %}"
    "{%- if tools %}<|system|>"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>'
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "<|system|>{{ messages[0]['content'] }}<|end|>"
    "{%- endif %}"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'assistant' and m.tool_calls %}"
    "<|assistant|>{{ m['content'] or '' }}"
    "{%- for call in m.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": {{ f.name | tojson }}, "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}"
    "{% endif %}}\n</tool_call>"
    "{%- endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' %}"
    "<|tool|><tool_response>\n{{ m['content'] }}\n</tool_response><|end|>"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tool_model_recipe(*, seed: int = 0) -> tiny_model.TinyLlama:
    """The tool model's recipe: the tiny Llama with the tool role, tags and template."""
    return tiny_model.TinyLlama(
        seed=seed,
        extra_special_tokens=(TOOL_ROLE,),
        added_tokens=TOOL_TAGS,
        chat_template=TOOL_CHAT_TEMPLATE,
    )


def build_tiny_tool_model(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny tool-calling chat model into ``path`` once; return ``path``.

    Architecture ``LlamaForCausalLM`` (the tiny Llama) with a Hermes-style template
    that renders ``tools``, assistant ``tool_calls`` and ``tool`` messages: the format
    vLLM's ``hermes`` tool parser reads, chosen because it is the most common one
    among open tool-calling models and needs no tokens beyond a few tags. Without
    ``tools`` a conversation renders as the tiny Llama's.
    """
    return tiny_model.build_llama(path, tool_model_recipe(seed=seed))
