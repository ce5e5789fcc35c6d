"""OpenAI batch output and error-file lines: OpenAI's shapes, and the fast chat lines' bytes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmbatch.contract.spec import ApiEndpoint, JobSpec
from llmbatch.contract.states import ErrorClass, ItemStatus
from llmbatch.formats.openai_output import (
    BATCH_EXPIRED,
    BATCH_EXPIRED_MESSAGE,
    ChatLines,
    dead_line,
    embedding_output_line,
    error_line,
    output_line,
    result_line,
)
from llmbatch.formats.writers import write_jsonl
from llmbatch.ledger.items import LedgerRow


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
    # The line by its number: never the object's address (an API batch's file is internal).
    assert failed["error"] == {"code": "PromptTooLong", "message": "too long (line 3)"}
    unplaced = dead_line(
        job_id="j", custom_id="c", error_class=ErrorClass.INVALID_REQUEST, message="bad",
        source="s3://b/in.jsonl",
    )  # fmt: skip
    assert unplaced["error"]["message"] == "bad"
    assert unplaced["response"]["body"]["error"]["message"] == "bad"


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
