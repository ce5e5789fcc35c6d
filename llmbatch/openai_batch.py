"""OpenAI batch JSONL: request lines in, OpenAI-shaped output and error lines out.

Input lines are ``{custom_id, method, url, body}`` with ``url`` = /v1/chat/completions
(generate jobs) or /v1/embeddings (embed jobs). Output follows the OpenAI Batch API:
one output line per succeeded request and one error-file line per failed request,
matched by ``custom_id``.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from llmbatch.config import model_identity
from llmbatch.contract.spec import ApiEndpoint, EmbedSpec, SamplingSpec, Task

CHAT_COMPLETIONS_URL = ApiEndpoint.CHAT_COMPLETIONS.value
EMBEDDINGS_URL = ApiEndpoint.EMBEDDINGS.value
# The request kind each task runs.
TASK_URLS = {Task.GENERATE: CHAT_COMPLETIONS_URL, Task.EMBED: EMBEDDINGS_URL}
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
    custom_id, body = _line(line, Task.GENERATE)
    _check_model(body.get("model"), model)
    _check_parameters(body)
    if body.get("n", 1) != 1:
        raise InvalidRequest("n other than 1 is not supported")
    return custom_id, _messages(body.get("messages")), _sampling(body, defaults)


class WrongTask(InvalidRequest):
    """A line of the other task's kind (a /v1/embeddings line in a generate job, or the
    other way round). One such line is dead-lettered; planning refuses a job whose
    first lines all are (a file of the other kind, submitted without ``--task``)."""


def _line(line: dict[str, Any], task: Task) -> tuple[str, dict[str, Any]]:
    """(custom_id, body) of a line for a ``task`` job; raise InvalidRequest."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest("custom_id is missing or not a string")
    url = line.get("url")
    if url != TASK_URLS[task]:
        other = next((t for t, u in TASK_URLS.items() if u == url), None)
        if other is not None:
            raise WrongTask(f"url {url} is for {other} jobs (task {other!r}), not a {task} job")
        raise InvalidRequest(f"url {url!r} is not supported; use {TASK_URLS[task]}")
    if str(line.get("method", "POST")).upper() != "POST":
        raise InvalidRequest("method must be POST")
    body = line.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body is missing or not an object")
    return custom_id, body


# /v1/embeddings body parameters llm-batch runs (OpenAI's, less token-id input).
EMBEDDING_PARAMETERS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})
ENCODING_FORMATS = ("float", "base64")


def parse_embedding_request(
    line: dict[str, Any], *, defaults: EmbedSpec, model: str
) -> tuple[str, list[str], EmbedSpec]:
    """Map one /v1/embeddings batch line of an embed job on ``model`` to (custom_id,
    texts, embed options); raise InvalidRequest. ``input`` is a string or a list of
    strings (one vector each); token-id input is refused."""
    custom_id, body = _line(line, Task.EMBED)
    _check_model(body.get("model"), model)
    for name in sorted(body):
        if name not in EMBEDDING_PARAMETERS and body[name] is not None:
            raise UnsupportedParameter(
                f"body.{name} is not supported; supported: "
                + ", ".join(sorted(EMBEDDING_PARAMETERS))
            )
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts:
        raise InvalidRequest("body.input must be a string or a non-empty list of strings")
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("body.input: only text input is supported (not token ids)")
    if any(not t for t in texts):
        raise InvalidRequest("body.input holds an empty string")
    encoding_format(body)
    options = defaults
    if body.get("dimensions") is not None:
        try:
            options = defaults.with_overrides({"dimensions": body["dimensions"]})
        except ValueError as exc:
            raise InvalidRequest(f"invalid dimensions: {body['dimensions']!r}") from exc
    return custom_id, texts, options


def encoding_format(body: Any) -> str:
    """The line's ``encoding_format`` (default ``float``); raise InvalidRequest."""
    value = (body.get("encoding_format") if isinstance(body, dict) else None) or "float"
    if value not in ENCODING_FORMATS:
        raise InvalidRequest(f"encoding_format {value!r} is not supported; use float or base64")
    return str(value)


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


def embedding_output_line(
    *,
    job_id: str,
    custom_id: str,
    model: str,
    vectors: list[list[float]] | list[bytes],
    encoding: str,
    prompt_tokens: int,
) -> dict[str, Any]:
    """A succeeded /v1/embeddings request, as the OpenAI Batch API writes it. With
    ``encoding`` base64, ``vectors`` are the little-endian float32 bytes of each."""
    key = _short_hash(job_id, custom_id)
    data = [
        {
            "object": "embedding",
            "embedding": base64.b64encode(v).decode() if isinstance(v, bytes) else v,
            "index": index,
        }
        for index, v in enumerate(vectors)
    ]
    if encoding != "base64" and any(isinstance(v, bytes) for v in vectors):
        raise ValueError("float encoding wants lists of floats")
    return {
        "id": f"batch_req_{key}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{key}",
            "body": {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            },
        },
        "error": None,
    }
