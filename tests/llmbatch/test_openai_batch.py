from __future__ import annotations

from typing import Any

import pytest

from llmbatch.contract.spec import EmbedSpec, SamplingSpec
from llmbatch.openai_batch import (
    InvalidRequest,
    UnsupportedParameter,
    WrongTask,
    embedding_output_line,
    error_line,
    output_line,
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
    assert sampling.json_schema == {"type": "object"}


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
        ({"body": {"messages": [{"role": "user", "content": "x"}], "n": 2}}, "n other than 1"),
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
        ({"frobnicate": 1}, r"body\.frobnicate is not supported; supported: max_completion"),
        ({"logit_bias": {"50256": -100}}, r"body\.logit_bias=\{'50256': -100\} is not supported"),
        ({"presence_penalty": 0.5}, r"body\.presence_penalty=0\.5"),
        ({"stream": True}, r"body\.stream=True"),
        ({"tools": [{"type": "function"}]}, r"body\.tools is not supported"),
    ],
)
def test_unsupported_body_parameters_are_named_not_dropped(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedParameter, match=message) as refused:
        parse_request(line(**body), defaults=SamplingSpec(), model="m")
    # Still an InvalidRequest: the line is dead-lettered under that class.
    assert isinstance(refused.value, InvalidRequest)


def test_parameters_that_ask_for_nothing_are_accepted() -> None:
    _, _, sampling = parse_request(
        line(
            user="u-1", metadata={"k": "v"}, store=False, stream=False, logprobs=False,
            frequency_penalty=0, presence_penalty=0.0, logit_bias={}, tools=None, n=1,
            seed=3, top_p=0.5, max_tokens=9, response_format={"type": "text"},
        ),
        defaults=SamplingSpec(), model="m",
    )  # fmt: skip
    assert (sampling.seed, sampling.top_p, sampling.max_tokens) == (3, 0.5, 9)


def test_output_and_error_lines_have_the_openai_shape() -> None:
    out = output_line(
        job_id="j",
        custom_id="a",
        model="m",
        text="hello",
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=2,
        created=1,
    )
    assert out["response"]["status_code"] == 200
    assert out["response"]["body"]["usage"]["total_tokens"] == 5
    assert out["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    err = error_line(job_id="j", custom_id="a", code="InvalidRequest", message="bad")
    assert err["id"] == out["id"] and err["response"] is None
    assert err["error"] == {"code": "InvalidRequest", "message": "bad"}


def embedding_line(**body: Any) -> dict[str, Any]:
    return {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": body}


def test_embedding_lines_take_a_string_or_a_list_and_dimensions() -> None:
    defaults = EmbedSpec(normalize=False)
    assert parse_embedding_request(
        embedding_line(model="m", input="hi"), defaults=defaults, model="m"
    ) == ("e", ["hi"], defaults)
    _, texts, options = parse_embedding_request(
        embedding_line(input=["a", "b"], dimensions=32, encoding_format="base64"),
        defaults=defaults,
        model="m",
    )
    assert texts == ["a", "b"] and options == EmbedSpec(dimensions=32, normalize=False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": [1, 2]}, "token ids"),
        ({"input": []}, "non-empty list"),
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


def test_embedding_output_lines_have_the_openai_shape() -> None:
    line = embedding_output_line(
        job_id="j", custom_id="e", model="m", vectors=[b"\x00\x00\x80\x3f"], encoding="base64",
        prompt_tokens=3,
    )  # fmt: skip
    assert line["custom_id"] == "e" and line["error"] is None
    body = line["response"]["body"]
    assert body["object"] == "list" and body["model"] == "m"
    assert body["data"] == [{"object": "embedding", "embedding": "AACAPw==", "index": 0}]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
