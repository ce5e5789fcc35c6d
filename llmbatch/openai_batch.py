"""OpenAI batch JSONL: request lines in, OpenAI-shaped output and error lines out.

Input lines are ``{custom_id, method, url, body}`` with ``url`` = /v1/chat/completions.
Output follows the OpenAI Batch API: one output line per succeeded request and one
error-file line per failed request, matched by ``custom_id``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from llmbatch.config import model_identity
from llmbatch.contract.spec import SamplingSpec

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
# A line's body.model is quoted in its error, cut to this: a row may hold anything there.
MODEL_NAME_CHARS = 200


class InvalidRequest(ValueError):
    """An OpenAI batch line that llm-batch cannot run (never will: not retryable)."""


class UnsupportedParameter(InvalidRequest):
    """A body parameter llm-batch does not run. Dropping it would answer a different
    request than the one asked, so the line is refused; and since such a parameter
    comes from how the caller builds every request, planning refuses the whole job
    when its first lines carry one."""


# Body parameters mapped onto the request (see parse_request and _sampling).
MAPPED_PARAMETERS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "response_format",
        "n",
    }
)
# Parameters that do not change the answer: bookkeeping for the caller.
IGNORED_PARAMETERS = frozenset({"user", "metadata", "store"})
# Parameters accepted only at the value that asks for nothing (OpenAI's default).
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "logprobs": (False,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
}


def parse_request(
    line: dict[str, Any], *, defaults: SamplingSpec, model: str
) -> tuple[str, list[dict[str, str]], SamplingSpec]:
    """Map one batch line of a job on ``model`` to (custom_id, chat messages,
    sampling); raise InvalidRequest.

    A line may leave ``body.model`` out (the job's model runs it); a line naming
    another model is refused, never run on the job's: its caller asked for that model.
    """
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest("custom_id is missing or not a string")
    if line.get("url") != CHAT_COMPLETIONS_URL:
        raise InvalidRequest(
            f"url {line.get('url')!r} is not supported; use {CHAT_COMPLETIONS_URL}"
        )
    if str(line.get("method", "POST")).upper() != "POST":
        raise InvalidRequest("method must be POST")
    body = line.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body is missing or not an object")
    _check_model(body.get("model"), model)
    _check_parameters(body)
    if body.get("n", 1) != 1:
        raise InvalidRequest("n other than 1 is not supported")
    return custom_id, _messages(body.get("messages")), _sampling(body, defaults)


def _check_model(named: Any, model: str) -> None:
    if named is None:
        return
    if not isinstance(named, str):
        raise InvalidRequest("body.model must be a string")
    if model_identity(named) != model_identity(model):
        shown = named if len(named) <= MODEL_NAME_CHARS else named[:MODEL_NAME_CHARS] + "..."
        raise InvalidRequest(
            f"body.model {shown!r} is not this job's model {model!r}; "
            "submit lines for another model as a job of that model"
        )


def _check_parameters(body: dict[str, Any]) -> None:
    for name in sorted(body):
        if name in MAPPED_PARAMETERS or name in IGNORED_PARAMETERS:
            continue
        value = body[name]
        if value is None or (name in NO_OP_VALUES and value in NO_OP_VALUES[name]):
            continue
        if name in NO_OP_VALUES:
            raise UnsupportedParameter(f"body.{name}={value!r} is not supported")
        raise UnsupportedParameter(
            f"body.{name} is not supported; supported: {', '.join(sorted(MAPPED_PARAMETERS))}"
        )


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("body.messages must be a non-empty list")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"body.messages[{index}] has no role")
        content = message.get("content")
        if isinstance(content, list):
            # Content parts: only text can be run by a text model.
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequest(f"body.messages[{index}] has a non-text content part")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidRequest(f"body.messages[{index}].content must be text")
        messages.append({"role": message["role"], "content": content})
    return messages


def _sampling(body: dict[str, Any], defaults: SamplingSpec) -> SamplingSpec:
    values = defaults.model_dump(exclude={"choice", "json_schema", "regex"})
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            values[key] = body[key]
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        values["stop"] = [stop] if isinstance(stop, str) else stop
    response_format = body.get("response_format") or {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object")
        values["json_schema"] = schema
    elif kind == "json_object":
        values["json_schema"] = {"type": "object"}
    elif kind not in (None, "text"):
        raise InvalidRequest(f"response_format type {kind!r} is not supported")
    try:
        return SamplingSpec.model_validate(values)
    except ValueError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]


def output_line(
    *,
    job_id: str,
    custom_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    created: int,
) -> dict[str, Any]:
    """A succeeded request, as the OpenAI Batch API writes it to the output file."""
    key = _short_hash(job_id, custom_id)
    return {
        "id": f"batch_req_{key}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{key}",
            "body": {
                "id": f"chatcmpl-{key}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        },
        "error": None,
    }


def error_line(*, job_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A failed request, as the OpenAI Batch API writes it to the error file."""
    return {
        "id": f"batch_req_{_short_hash(job_id, custom_id)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
