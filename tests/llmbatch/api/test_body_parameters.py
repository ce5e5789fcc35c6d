"""Request bodies run as vLLM runs them, through the official client on a real
``llm-batch serve``, the session's GPU worker and its engine: every sampling parameter
vLLM takes is accepted and honoured, ``n`` gives n choices, logprobs come back in
OpenAI's shape, JSON cut at max_tokens comes back with finish_reason "length",
completions take token-id prompts, and a parameter that cannot run is that line's 400
while the other lines succeed.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.api_server import ApiServer, Keys
from tests.llmbatch.api.helpers import lines_of, new_client, submit

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_line(model: str, custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a story."}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


async def run(
    client: openai.AsyncOpenAI, lines: list[dict[str, Any]], endpoint: str = CHAT
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Run ``lines`` as one batch to the end; its output and error lines by custom_id.
    The batch must complete: no line may fail it."""
    batch = await submit(client, lines, endpoint)
    assert batch.status == "completed", batch
    out = {x["custom_id"]: x for x in await lines_of(client, batch.output_file_id)}
    err = {x["custom_id"]: x for x in await lines_of(client, batch.error_file_id)}
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), len(err))
    return out, err


def body_of(line: dict[str, Any]) -> dict[str, Any]:
    assert line["error"] is None and line["response"]["status_code"] == 200, line
    return dict(line["response"]["body"])


async def test_sampling_parameters_vllm_runs_are_accepted_and_honoured(
    served_model: str, model_name: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    forced = tokenizer.encode("story", add_special_tokens=False)[0]
    lines = [
        # Every parameter a probe found refused, on one line: it runs.
        chat_line(
            served_model,
            "all",
            max_tokens=6,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={"7": -5},
            top_k=5,
            min_p=0.05,
            repetition_penalty=1.2,
            stop_token_ids=[tokenizer.eos_token_id],
            parallel_tool_calls=False,
            service_tier="auto",
            stream=False,
            stream_options={"include_usage": True},
            seed=7,
            temperature=0.8,
        ),
        # logit_bias honoured: +100 on one token makes greedy decoding pick only it.
        chat_line(served_model, "bias", max_tokens=4, logit_bias={str(forced): 100}),
        # min_tokens honoured: no stop before it (the end-of-text token is held back).
        chat_line(served_model, "min", max_tokens=9, min_tokens=9, ignore_eos=False),
    ]
    out, err = await run(client, lines)
    assert err == {} and set(out) == {"all", "bias", "min"}
    assert body_of(out["all"])["choices"][0]["finish_reason"] in ("stop", "length")
    bias = body_of(out["bias"])
    assert bias["choices"][0]["message"]["content"] == tokenizer.decode([forced] * 4)
    assert bias["usage"]["completion_tokens"] == 4
    assert body_of(out["min"])["usage"]["completion_tokens"] == 9


async def test_n_gives_n_choices_and_logprobs_come_back_in_openais_shape(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [
        chat_line(served_model, "two", max_tokens=5, n=2, seed=1),
        chat_line(served_model, "logprobs", max_tokens=5, logprobs=True, top_logprobs=2),
    ]
    out, err = await run(client, lines)
    assert err == {}
    two = body_of(out["two"])
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in two["choices"])
    # Usage counts the tokens of every choice.
    assert two["usage"]["completion_tokens"] >= 2
    (choice,) = body_of(out["logprobs"])["choices"]
    content = choice["logprobs"]["content"]
    assert content and len(content) == body_of(out["logprobs"])["usage"]["completion_tokens"]
    assert "".join(step["token"] for step in content) == choice["message"]["content"]
    for step in content:
        assert step["logprob"] <= 0.0 and step["bytes"] == list(step["token"].encode())
        assert len(step["top_logprobs"]) == 2
        # The sampled token (greedy) is the most likely one.
        assert step["top_logprobs"][0]["logprob"] == pytest.approx(step["logprob"])
    # The official client reads the body as a chat completion.
    from openai.types.chat import ChatCompletion

    assert len(ChatCompletion.model_validate(two).choices) == 2


async def test_json_cut_at_max_tokens_returns_its_text_with_finish_reason_length(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [
        chat_line(served_model, "cut", max_tokens=3, response_format={"type": "json_object"}),
    ]
    out, err = await run(client, lines)
    assert err == {}
    (choice,) = body_of(out["cut"])["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].lstrip().startswith(("{", "["))


async def test_completions_take_token_id_prompts(
    served_model: str, model_name: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    ids = tokenizer.encode("Once upon a time")

    def line(custom_id: str, prompt: Any, **body: Any) -> dict[str, Any]:
        body = {"model": served_model, "prompt": prompt, "max_tokens": 5, **body}
        return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}

    lines = [
        line("text", "Once upon a time"),
        line("ids", ids),
        line("nested", [ids]),
        line("logprobs", ids, logprobs=1, n=2, temperature=0.7, seed=3),
    ]
    out, err = await run(client, lines, COMPLETIONS)
    assert err == {}
    # Greedy: the text and its own token ids give the same completion.
    texts = {cid: [c["text"] for c in body_of(line)["choices"]] for cid, line in out.items()}
    assert texts["ids"] == texts["nested"] == texts["text"]
    assert body_of(out["ids"])["usage"]["prompt_tokens"] == len(ids)
    # Completions' logprobs: parallel lists, one entry a generated token, per choice.
    choices = body_of(out["logprobs"])["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        logprobs = choice["logprobs"]
        steps = len(logprobs["tokens"])
        assert steps and all(len(logprobs[k]) == steps for k in ("token_logprobs", "top_logprobs"))
        assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])


async def test_a_parameter_that_cannot_run_is_its_lines_400_and_the_rest_succeed(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    lines = [
        chat_line(served_model, "stream", stream=True),
        chat_line(served_model, "ok-1", max_tokens=3),
        chat_line(served_model, "tools", tools=[tool]),
        chat_line(served_model, "typo", max_tokens=3, frobnicate=1),
        chat_line(served_model, "bad-value", max_tokens=3, top_logprobs=3),  # needs logprobs
        chat_line(served_model, "ok-2", max_tokens=3, presence_penalty=1.0),
    ]
    out, err = await run(client, lines)
    assert set(out) == {"ok-1", "ok-2"}
    assert set(err) == {"stream", "tools", "typo", "bad-value"}
    for line in err.values():
        assert line["response"]["status_code"] == 400, line
        error = line["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "InvalidRequest"
    assert "body.stream" in err["stream"]["response"]["body"]["error"]["message"]
    assert "tool parser" in err["tools"]["response"]["body"]["error"]["message"]
    assert "body.frobnicate" in err["typo"]["response"]["body"]["error"]["message"]
    assert "logprobs" in err["bad-value"]["response"]["body"]["error"]["message"]
