"""Batch input files and error-shape checks shared by the API tests."""

from __future__ import annotations

import json
from typing import Any

import openai

from llmbatch.contract.spec import ApiEndpoint


def request_line(
    model: str,
    n: int,
    *,
    endpoint: ApiEndpoint = ApiEndpoint.CHAT_COMPLETIONS,
    max_tokens: int = 8,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if endpoint is ApiEndpoint.CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": f"Say something about {n}."}]
    else:
        body["prompt"] = f"Something about {n}:"
    return {"custom_id": f"req-{n}", "method": "POST", "url": str(endpoint), "body": body}


def batch_file(model: str, count: int, **kwargs: Any) -> bytes:
    return b"".join(
        json.dumps(request_line(model, n, **kwargs)).encode() + b"\n" for n in range(count)
    )


def assert_openai_error(
    exc: openai.APIStatusError, *, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The answer is ``status`` in OpenAI's error shape (and has ``code``/``param``)."""
    assert exc.status_code == status, exc
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return dict(error)
