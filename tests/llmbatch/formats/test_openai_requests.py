"""Request lines of OpenAI batch JSONL into requests: what runs, what is refused and why."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.contract.spec import ApiEndpoint, EmbedSpec, SamplingSpec
from llmbatch.formats.openai_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    InvalidRequest,
    ParsedRequest,
    UnsupportedParameter,
    WrongTask,
    parse,
    parse_embedding_request,
    parse_request,
)


def line(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def test_body_maps_to_messages_and_sampling() -> None:
    custom_id, messages, sampling = parse_request(
        line(
            max_completion_tokens=7,
            temperature=0.5,
            stop="\n",
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        ),
        defaults=SamplingSpec(),
        model="m",
    )
    assert custom_id == "a"
    assert messages == [{"role": "user", "content": "hi"}]
    assert (sampling.max_tokens, sampling.temperature, sampling.stop) == (7, 0.5, ["\n"])
    # Run by vLLM's own request model in the engine worker, not mapped here.
    assert sampling.params == {
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    }


def test_text_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    _, messages, _ = parse_request(
        line(messages=[{"role": "user", "content": parts}]), defaults=SamplingSpec(), model="m"
    )
    assert messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"url": "/v1/responses"}, "not supported"),
        ({"custom_id": None}, "custom_id"),
        ({"body": {"messages": []}}, "non-empty"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "temperature": 9}}, "sampling"),
    ],
)
def test_requests_that_cannot_run_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_request({**line(), **change}, defaults=SamplingSpec(), model="m")


def test_a_line_for_another_model_is_refused_naming_both_models() -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(
            line(model="gpt-4o-mini", messages=[{"role": "user", "content": "PRIVATE ROW"}]),
            defaults=SamplingSpec(),
            model="/models/m",
        )
    assert "'gpt-4o-mini'" in str(refused.value) and "'/models/m'" in str(refused.value)
    assert "PRIVATE" not in str(refused.value)  # no row content beyond the model's name
    # No model in the body: the job's runs it, as it does for the same path with a slash.
    for same in ({}, {"model": "/models/m/"}):
        body = {"messages": [{"role": "user", "content": "x"}], **same}
        parse_request({**line(), "body": body}, defaults=SamplingSpec(), model="/models/m")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stream": True}, r"body\.stream=true is not supported"),
        ({"tools": [{"type": "function"}]}, r"body\.tools is not supported: .*tool parser"),
        ({"echo": True}, r"body\.echo=true"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_parameter(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedParameter, match=message) as refused:
        parse_request(line(**body), defaults=SamplingSpec(), model="m")
    # Still an InvalidRequest: the line is dead-lettered under that class (a 400).
    assert isinstance(refused.value, InvalidRequest)


def test_every_other_parameter_travels_to_the_engine_as_given() -> None:
    given = {
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "logprobs": True,
        "top_logprobs": 2, "logit_bias": {"5": -100}, "top_k": 3, "min_p": 0.1,
        "min_tokens": 2, "repetition_penalty": 1.1, "stop_token_ids": [3],
        "parallel_tool_calls": True, "n": 2, "frobnicate": 1,
    }  # fmt: skip
    _, _, sampling = parse_request(
        line(
            **given, user="u-1", metadata={"k": "v"}, store=False, stream=False,
            service_tier="auto", stream_options={"include_usage": True}, tools=None,
            seed=3, top_p=0.5, max_tokens=9,
        ),
        defaults=SamplingSpec(), model="m",
    )  # fmt: skip
    assert (sampling.seed, sampling.top_p, sampling.max_tokens) == (3, 0.5, 9)
    # Bookkeeping and delivery options are dropped; a name vLLM does not know is the
    # engine worker's to refuse (it checks against vLLM's request models).
    assert sampling.params == given
    # n answers need sampling: without a temperature, OpenAI's default.
    assert sampling.temperature == 1.0


def test_a_completions_prompt_may_be_token_ids() -> None:
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        parsed = parse(
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": prompt}},
            defaults=SamplingSpec(),
            model="m",
            endpoint=ApiEndpoint.COMPLETIONS,
        )
        assert (parsed.prompt, parsed.prompt_token_ids) == (None, [1, 2, 3])


# --- /v1/completions -------------------------------------------------------------------


def completion(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "Once upon", **body},
    }


def parse_completion(request: dict[str, Any]) -> ParsedRequest:
    return parse(request, defaults=SamplingSpec(), model="m", endpoint=ApiEndpoint.COMPLETIONS)


def test_a_completion_runs_its_prompt_as_given_with_openais_max_tokens_default() -> None:
    parsed = parse_completion(completion(temperature=0.3, stop="\n"))
    assert (parsed.custom_id, parsed.prompt, parsed.messages) == ("c", "Once upon", None)
    assert parsed.sampling.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert (parsed.sampling.temperature, parsed.sampling.stop) == (0.3, ["\n"])
    assert parse_completion(completion(max_tokens=9)).sampling.max_tokens == 9


def test_a_list_of_one_prompt_is_that_prompt() -> None:
    assert parse_completion(completion(prompt=["only one"])).prompt == "only one"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([[1, 2], [3]], "exactly one"),
        (["a", "b"], "exactly one"),
        ([1, -2], "exactly one"),
        ([], "missing"),
        (None, "missing"),
        (7, "missing"),
    ],
)
def test_prompts_that_are_not_one_text_are_refused(prompt: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_completion(completion(prompt=prompt))


def test_a_completion_refuses_chat_only_parameters_and_the_other_endpoint() -> None:
    with pytest.raises(UnsupportedParameter, match=r"body\.messages"):
        parse_completion(completion(messages=[{"role": "user", "content": "x"}]))
    with pytest.raises(UnsupportedParameter, match=r"body\.suffix"):
        parse_completion(completion(suffix="end"))
    with pytest.raises(InvalidRequest, match="/v1/completions"):
        parse_completion({**completion(), "url": "/v1/chat/completions"})
    # A plain job (no API batch) runs chat lines only, as before.
    with pytest.raises(InvalidRequest, match="/v1/chat/completions"):
        parse(completion(), defaults=SamplingSpec(), model="m")


def embedding_line(**body: Any) -> dict[str, Any]:
    return {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": body}


def test_embedding_lines_take_a_string_or_a_list_and_dimensions() -> None:
    defaults = EmbedSpec(normalize=False)
    assert parse_embedding_request(
        embedding_line(model="m", input="hi"), defaults=defaults, model="m"
    ) == ("e", ["hi"], None, defaults)
    # Token ids, one list or several, as OpenAI and vLLM take them.
    for asked, ids in (([1, 2], [[1, 2]]), ([[1, 2], [3]], [[1, 2], [3]])):
        parsed = parse_embedding_request(embedding_line(input=asked), defaults=defaults, model="m")
        assert parsed == ("e", [], ids, defaults)
    _, texts, _, options = parse_embedding_request(
        embedding_line(input=["a", "b"], dimensions=32, encoding_format="base64"),
        defaults=defaults,
        model="m",
    )
    assert texts == ["a", "b"] and options == EmbedSpec(dimensions=32, normalize=False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": [[1, 2], []]}, "token ids must be non-empty"),
        ({"input": ["a", 2]}, "must be a string"),
        ({"input": []}, "not empty"),
        ({"input": ""}, "empty string"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "model": "other"}, "not this job's model"),
    ],
)
def test_embedding_lines_that_cannot_run_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_embedding_request(embedding_line(**body), defaults=EmbedSpec(), model="m")


def test_a_line_of_the_other_task_refuses_the_job_naming_the_task() -> None:
    with pytest.raises(WrongTask, match="for embed jobs"):
        parse_request(embedding_line(input="x"), defaults=SamplingSpec(), model="m")
    with pytest.raises(WrongTask, match="for generate jobs"):
        parse_embedding_request(line(), defaults=EmbedSpec(), model="m")
    with pytest.raises(UnsupportedParameter, match=r"body\.user_vectors"):
        parse_embedding_request(
            embedding_line(input="x", user_vectors=1), defaults=EmbedSpec(), model="m"
        )
