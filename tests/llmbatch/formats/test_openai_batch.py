from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.contract.spec import ApiEndpoint, EmbedSpec, JobSpec, SamplingSpec
from llmbatch.contract.states import ErrorClass, ItemStatus
from llmbatch.formats.openai_batch import (
    BATCH_EXPIRED,
    BATCH_EXPIRED_MESSAGE,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    BatchValidator,
    ChatLines,
    InvalidRequest,
    ParsedRequest,
    UnsupportedParameter,
    WrongTask,
    dead_line,
    embedding_output_line,
    error_line,
    output_line,
    parse,
    parse_embedding_request,
    parse_request,
    result_line,
)
from llmbatch.formats.writers import write_jsonl
from llmbatch.ledger.items import LedgerRow


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


def test_a_completion_output_line_is_a_text_completion() -> None:
    out = output_line(
        job_id="j",
        custom_id="c",
        model="m",
        text=" a time",
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=2,
        created=11,
        endpoint=ApiEndpoint.COMPLETIONS,
    )
    body = out["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"text": " a time", "index": 0, "finish_reason": "length", "logprobs": None}
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


# --- validation of a whole batch file --------------------------------------------------


def validate(
    lines: Sequence[bytes | None], *, max_requests: int = 100, max_errors: int = 100
) -> list[tuple[int | None, str, str | None]]:
    validator = BatchValidator(
        endpoint=ApiEndpoint.CHAT_COMPLETIONS,
        model="m",
        max_requests=max_requests,
        max_errors=max_errors,
    )
    for number, data in enumerate(lines, start=1):
        validator.add(number, data, max_bytes=1000)
        if validator.full:
            break
    return [(e.line, e.code, e.param) for e in validator.finish()]


def dump(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


def test_a_good_file_has_no_errors_and_a_trailing_slash_names_the_same_model() -> None:
    good = line()
    good["body"]["model"] = "m/"
    assert (
        validate(
            [dump(line()), dump({**line(), "custom_id": "b"}), dump(good | {"custom_id": "c"})]
        )
        == []
    )


def test_every_fault_is_reported_with_its_line_code_and_param() -> None:
    lines = [
        dump(line()),
        b"{oops\n",
        b"[1, 2]\n",
        dump({k: v for k, v in line().items() if k != "body"}),
        dump({**line(), "method": "PUT", "custom_id": "d"}),
        dump({**line(), "url": "/v1/completions", "custom_id": "e"}),
        dump(line()),
        dump({**line(), "custom_id": "g", "body": {"model": "other", "messages": []}}),
        None,
    ]
    assert validate(lines) == [
        (2, "invalid_json_line", None),
        (3, "invalid_json_line", None),
        (4, "missing_required_parameter", "body"),
        (5, "invalid_method", "method"),
        (6, "url_mismatch", "url"),
        (7, "duplicate_custom_id", "custom_id"),
        (8, "model_mismatch", "body.model"),
        (9, "line_too_large", None),
    ]


def test_an_empty_file_and_too_many_requests_are_errors_of_the_file() -> None:
    assert validate([]) == [(None, "empty_file", None)]
    many = [dump({**line(), "custom_id": str(i)}) for i in range(5)]
    assert validate(many, max_requests=3) == [(None, "too_many_tasks", None)]


def test_every_invalid_line_is_named_past_the_entries_kept_one_by_one() -> None:
    """Four lines get an entry each; every other invalid line is named in one entry
    per code, its lines as ranges, however many there are."""
    lines = [b"x\n"] * 6 + [dump(line())] + [b"y\n"] * 3
    lines += [dump({**line(), "custom_id": "u", "url": "/v1/completions"}), b"z\n"]
    validator = BatchValidator(
        endpoint=ApiEndpoint.CHAT_COMPLETIONS, model="m", max_requests=100, max_errors=4
    )
    for number, data in enumerate(lines, start=1):
        validator.add(number, data, max_bytes=1000)
    errors = validator.finish()
    assert [(e.line, e.code) for e in errors[:4]] == [
        (n, "invalid_json_line") for n in (1, 2, 3, 4)
    ]
    more = {e.code: e for e in errors[4:]}
    assert set(more) == {"invalid_json_line", "url_mismatch"} and len(errors) == 6
    assert more["invalid_json_line"].line == 5
    assert more["invalid_json_line"].message.endswith("lines 5-6, 8-10, 12.")
    assert more["invalid_json_line"].message.startswith("6 more lines with this error")
    assert more["url_mismatch"].message.endswith(": line 11.")
    assert more["url_mismatch"].param == "url"


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
    as_floats = embedding_output_line(
        job_id="j", custom_id="e", model="m", vectors=[b"\x00\x00\x80\x3f"], encoding="float",
        prompt_tokens=3,
    )  # fmt: skip
    assert as_floats["response"]["body"]["data"][0]["embedding"] == [1.0]


def test_a_dead_request_that_never_ran_gets_openais_code_the_rest_their_class() -> None:
    expired = dead_line(
        job_id="j", custom_id="a", error_class=ErrorClass.BATCH_EXPIRED, message=None, source=None
    )
    assert expired["error"] == {"code": BATCH_EXPIRED, "message": BATCH_EXPIRED_MESSAGE}
    failed = dead_line(
        job_id="j",
        custom_id="b",
        error_class=ErrorClass.PROMPT_TOO_LONG,
        message="too long",
        source="s3://b/in.jsonl:line 3",
    )
    assert failed["response"] is None and failed["custom_id"] == "b"
    assert failed["error"] == {
        "code": "PromptTooLong",
        "message": "too long (s3://b/in.jsonl:line 3)",
    }


_TEXT = st.text() | st.sampled_from(
    ["", "plain", 'quotes " and \\ back', "é ü 中文 🙂", "\n\t\x00"]
)
_RESULT = st.fixed_dictionaries(
    {},
    optional={
        "text": _TEXT | st.none() | st.integers(),
        "finish_reason": st.sampled_from(["stop", "length", None]) | st.text() | st.integers(),
        "parsed": st.none() | st.dictionaries(st.text(), st.integers(), max_size=2),
        "choices": st.none()
        | st.just([])
        | st.just([{"index": 0, "text": "a", "finish_reason": "stop"}]),
    },
)


@given(
    result=st.none() | _RESULT,
    item_id=_TEXT,
    job_id=_TEXT,
    model=_TEXT,
    tokens=st.tuples(st.none() | st.integers(0, 10**9), st.none() | st.integers(0, 10**9)),
    finished_at=st.none() | st.datetimes(timezones=st.just(UTC)),
    endpoint=st.sampled_from(list(ApiEndpoint)),
)
def test_chat_lines_are_the_bytes_of_the_result_lines_dicts(
    result: dict[str, Any] | None,
    item_id: str,
    job_id: str,
    model: str,
    tokens: tuple[int | None, int | None],
    finished_at: datetime | None,
    endpoint: ApiEndpoint,
) -> None:
    # The write step encodes most lines straight to bytes (ChatLines): they must be
    # what the line's dict encodes to, byte for byte, or it says it cannot and the
    # dict is written.
    spec = JobSpec(job_id="j", inputs=["s3://b/in.jsonl"], model="m", output_uri="s3://b/out")
    spec = spec.model_copy(update={"job_id": job_id, "model": model, "endpoint": endpoint})
    row = LedgerRow(
        item_id, 0, ItemStatus.SUCCEEDED, 0, None, result, *tokens, 0.0, None, None, finished_at
    )
    buffer = bytearray(b"before\n")
    encoded = ChatLines(spec).encode_into(buffer, row)
    if encoded:
        assert bytes(buffer) == b"before\n" + write_jsonl([result_line(spec, row)])
        assert json.loads(buffer[7:])["custom_id"] == item_id
    else:
        assert buffer == b"before\n"
        assert (
            endpoint is not ApiEndpoint.CHAT_COMPLETIONS
            or (result or {}).get("choices")
            or (
                not isinstance((result or {}).get("text") or "", str)
                or not isinstance((result or {}).get("finish_reason"), str | None)
            )
        )
