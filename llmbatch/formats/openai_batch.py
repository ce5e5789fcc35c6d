"""OpenAI batch JSONL: request lines in, OpenAI-shaped output and error lines out.

Input lines are ``{custom_id, method, url, body}`` with ``url`` = /v1/chat/completions
(or, in a batch of the OpenAI Batch API created for that endpoint, /v1/completions)
for generate jobs, or /v1/embeddings for embed jobs. Output follows the OpenAI Batch
API: one output line per succeeded request and one error-file line per failed request,
matched by ``custom_id``.

About 600 lines, on purpose: it is one format, read against OpenAI's one reference
(request lines, output and error lines, and the validation of a whole file share the
parameter tables and the error codes above).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from pydantic import BaseModel, ConfigDict

from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import (
    NOT_SAMPLING_PARAMS,
    SAMPLING_FIELD_PARAMS,
    ApiEndpoint,
    EmbedSpec,
    JobSpec,
    SamplingSpec,
)
from llmbatch.contract.states import ErrorClass
from llmbatch.formats.vectors import floats

if TYPE_CHECKING:
    from llmbatch.ledger.items import LedgerRow

CHAT_COMPLETIONS_URL = ApiEndpoint.CHAT_COMPLETIONS.value
COMPLETIONS_URL = ApiEndpoint.COMPLETIONS.value
EMBEDDINGS_URL = ApiEndpoint.EMBEDDINGS.value
# OpenAI's /v1/completions default for max_tokens (vLLM's too): a line that leaves it
# out gets what it would get from OpenAI, not the job's chat default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's default temperature: a line asking for n > 1 answers without one gets it.
OPENAI_DEFAULT_TEMPERATURE = 1.0
# A line's body.model is quoted in its error, cut to this: a row may hold anything there.
MODEL_NAME_CHARS = 200


class InvalidRequest(ValueError):
    """An OpenAI batch line that llm-batch cannot run (never will: not retryable)."""


class UnsupportedParameter(InvalidRequest):
    """A body parameter, or a value of one, that llm-batch cannot run (``stream: true``,
    ``tools`` without a tool parser). Dropping it would answer a different request than
    the one asked, so the line is refused: a 400 in the error file, as OpenAI reports
    a body error, while the other lines run. ``param`` names it (``body.<name>``) and
    ``code`` is OpenAI's: ``unsupported_parameter``, or ``unsupported_value`` for a
    parameter run only with some values."""

    def __init__(self, message: str, *, param: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# Body parameters that do not change the answer: bookkeeping for the caller, or how an
# answer is delivered, which a batch decides (whole answers, in the output file).
IGNORED_PARAMETERS = frozenset(
    {"user", "metadata", "store", "service_tier", "stream_options"}
    | {"prompt_cache_key", "safety_identifier"}
)
# Parameters run only at these values: the others ask for what a batch line cannot do
# here (stream deltas, a tool parser, the prompt echoed back, a suffix, beam search);
# each value refused names why.
ONLY_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((False,), "a batch returns whole answers, never a stream"),
    "echo": ((False,), "the prompt is not echoed back; it is in the input file"),
    "suffix": (("",), "a suffix needs an insertion model"),
    "best_of": ((1,), "ask for n candidates instead"),
    "use_beam_search": ((False,), "beam search is not run for batch lines"),
    "tools": (([],), "the engine workers run no tool parser"),
    "functions": (([],), "the engine workers run no tool parser"),
}
_ONLY_VALUE_NAMES = frozenset(ONLY_VALUES)


class ParsedRequest(msgspec.Struct, frozen=True):
    """One batch line, ready to run: chat ``messages``, or a raw ``prompt`` as text or
    as the model's token ids (a /v1/completions line). A struct, not a dataclass: one
    is made for each line a shard renders, a fifth of the time a frozen dataclass takes."""

    custom_id: str
    sampling: SamplingSpec
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None


def parse_request(
    line: dict[str, Any], *, defaults: SamplingSpec, model: str
) -> tuple[str, list[dict[str, str]], SamplingSpec]:
    """Map one chat batch line of a job on ``model`` to (custom_id, chat messages,
    sampling); raise InvalidRequest. See :func:`parse`."""
    parsed = parse(line, defaults=defaults, model=model)
    assert parsed.messages is not None  # a chat line
    return parsed.custom_id, parsed.messages, parsed.sampling


def parse(
    line: dict[str, Any],
    *,
    defaults: SamplingSpec,
    model: str,
    endpoint: ApiEndpoint = ApiEndpoint.CHAT_COMPLETIONS,
    samplings: dict[bytes, SamplingSpec] | None = None,
    bodies: dict[bytes, ParsedRequest] | None = None,
) -> ParsedRequest:
    """Map one batch line of a job on ``model`` whose requests go to ``endpoint``
    (a plain job's: chat completions) to a request; raise InvalidRequest.

    A line may leave ``body.model`` out (the job's model runs it); a line naming
    another model is refused, never run on the job's: its caller asked for that model.
    A /v1/completions line's prompt runs as given, without a chat template.

    There is no list of parameters here: the parameters SamplingSpec has fields for
    are mapped onto them, and every other one travels in ``SamplingSpec.params`` to the
    engine worker, which builds the request with vLLM's own request model (a name or
    value vLLM refuses is then that item's InvalidRequest). Only what cannot run at all
    (:data:`ONLY_VALUES`) is refused here.

    ``samplings``, kept by a caller across the lines of one file with the same
    ``defaults``, holds the sampling of each set of sampling fields seen: lines that
    ask the same get the same (unchanged) object, validated once.

    ``bodies``, kept the same way (same ``defaults``, ``model`` and ``endpoint``),
    holds what each body seen parsed to: a line repeating an earlier line's body (the
    repeats deduplication is for) gets its messages and sampling objects again without
    parsing them again, and those shared objects let its request key be found again
    too (:func:`llmbatch.dedup.keys.request_key`'s callers).
    """
    custom_id, body = _line(line, endpoint)
    seen = None if bodies is None else _body_key(body)
    if bodies is None or seen is None:
        return _parse_body(custom_id, body, defaults, model, endpoint, samplings)
    earlier = bodies.get(seen)
    if earlier is None:
        earlier = bodies[seen] = _parse_body("", body, defaults, model, endpoint, samplings)
    return ParsedRequest(
        custom_id=custom_id,
        sampling=earlier.sampling,
        messages=earlier.messages,
        prompt=earlier.prompt,
        prompt_token_ids=earlier.prompt_token_ids,
    )


def _body_key(body: dict[str, Any]) -> bytes | None:
    """The bytes that tell a body from every body that parses differently; None when
    there are none to be had cheaply. msgspec writes NaN and infinities as null (as
    json would not read them back): a body with a null in its text gets no key."""
    try:
        key = _json(body)
    except (TypeError, ValueError, OverflowError):  # not plain JSON values
        return None
    return None if b"null" in key else key


def _parse_body(
    custom_id: str,
    body: dict[str, Any],
    defaults: SamplingSpec,
    model: str,
    endpoint: ApiEndpoint,
    samplings: dict[bytes, SamplingSpec] | None,
) -> ParsedRequest:
    """:func:`parse` of a line's body, once its ``custom_id`` and ``body`` are known."""
    _check_model(body.get("model"), model)
    completions = endpoint is ApiEndpoint.COMPLETIONS
    _check_parameters(body)
    other = "messages" if completions else "prompt"
    if body.get(other) is not None:
        raise UnsupportedParameter(
            f"body.{other} is not a parameter of {endpoint.value}", param=f"body.{other}"
        )
    if completions:
        if body.get("max_tokens") is None:
            body = {**body, "max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS}
        text, ids = _prompt(body)
        return ParsedRequest(
            custom_id=custom_id,
            sampling=_sampling_of(body, defaults, samplings),
            prompt=text,
            prompt_token_ids=ids,
        )
    return ParsedRequest(
        custom_id=custom_id,
        sampling=_sampling_of(body, defaults, samplings),
        messages=_messages(body.get("messages")),
    )


def _sampling_of(
    body: dict[str, Any], defaults: SamplingSpec, samplings: dict[bytes, SamplingSpec] | None
) -> SamplingSpec:
    if samplings is None:
        return _sampling(body, defaults)
    # Every body field _sampling reads: all but the prompt's and the model's.
    fields = {k: v for k, v in body.items() if k not in NOT_SAMPLING_PARAMS}
    try:
        key = msgspec.json.encode(fields, order="sorted")
        if b"null" in key:
            # msgspec writes NaN and infinities as null too: such lines (and those with
            # a null in them) are told apart by json's text, which has spaces after
            # separators, so it never equals a compact key of msgspec's.
            key = json.dumps(fields, sort_keys=True).encode()
    except (TypeError, ValueError):  # not plain JSON values: no shortcut
        return _sampling(body, defaults)
    sampling = samplings.get(key)
    if sampling is None:
        sampling = samplings[key] = _sampling(body, defaults)
    return sampling


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """A /v1/completions prompt, as (text, None) or (None, token ids): a string, a list
    of token ids, or a list of exactly one of these (one request is one completion
    here). Token ids are the model's own (as OpenAI and vLLM take them)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        return raw, None
    if isinstance(raw, list) and raw and all(_token_id(t) for t in raw):
        return None, list(raw)
    if isinstance(raw, list) and raw:
        raise InvalidRequest(
            "body.prompt must be a string, a list of token ids, or a list of exactly one "
            "of these (send several prompts as several lines)"
        )
    raise InvalidRequest("body.prompt is missing or empty")


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class WrongTask(InvalidRequest):
    """A line of the other task's kind (a /v1/embeddings line in a generate job, or the
    other way round). One such line is dead-lettered; planning refuses a job whose
    first lines all are (a file of the other kind, submitted without ``--task``)."""


def _line(line: dict[str, Any], endpoint: ApiEndpoint) -> tuple[str, dict[str, Any]]:
    """(custom_id, body) of a line of a job whose requests go to ``endpoint``; raise
    InvalidRequest (WrongTask for a line of the other task's kind)."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest("custom_id is missing or not a string")
    url = line.get("url")
    if url != endpoint.value:
        task = endpoint.task
        other = next((e.task for e in ApiEndpoint if e.value == url), None)
        if other is not None and other is not task:
            raise WrongTask(f"url {url} is for {other} jobs (task {other!r}), not a {task} job")
        raise InvalidRequest(f"url {url!r} is not supported; use {endpoint.value}")
    if str(line.get("method", "POST")).upper() != "POST":
        raise InvalidRequest("method must be POST")
    body = line.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body is missing or not an object")
    return custom_id, body


# /v1/embeddings body parameters llm-batch runs (OpenAI's).
EMBEDDING_PARAMETERS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})
ENCODING_FORMATS = ("float", "base64")


def parse_embedding_request(
    line: dict[str, Any], *, defaults: EmbedSpec, model: str
) -> tuple[str, list[str], list[list[int]] | None, EmbedSpec]:
    """Map one /v1/embeddings batch line of an embed job on ``model`` to (custom_id,
    texts, token ids, embed options); raise InvalidRequest. ``input`` is a string, a
    list of strings, a list of token ids or a list of such lists (one vector each, as
    OpenAI and vLLM take them); token ids come back instead of texts."""
    custom_id, body = _line(line, ApiEndpoint.EMBEDDINGS)
    _check_model(body.get("model"), model)
    for name in sorted(body):
        if name not in EMBEDDING_PARAMETERS and body[name] is not None:
            raise UnsupportedParameter(
                f"body.{name} is not supported; supported: "
                + ", ".join(sorted(EMBEDDING_PARAMETERS)),
                param=f"body.{name}",
            )
    raw = body.get("input")
    texts: list[str] = []
    ids: list[list[int]] | None = None
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(_token_id(t) for t in raw):
        ids = [list(raw)]
    elif isinstance(raw, list) and raw and all(isinstance(t, list) for t in raw):
        if not all(t and all(_token_id(i) for i in t) for t in raw):
            raise InvalidRequest("body.input: each list of token ids must be non-empty ids")
        ids = [list(t) for t in raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    else:
        raise InvalidRequest(
            "body.input must be a string, a list of strings, a list of token ids or a "
            "list of lists of token ids, and not empty"
        )
    if any(not t for t in texts):
        raise InvalidRequest("body.input holds an empty string")
    encoding_format(body)
    options = defaults
    if body.get("dimensions") is not None:
        try:
            options = defaults.with_overrides({"dimensions": body["dimensions"]})
        except ValueError as exc:
            raise InvalidRequest(f"invalid dimensions: {body['dimensions']!r}") from exc
    return custom_id, texts, ids, options


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
    """Refuse, naming it, a parameter asked at a value that cannot run (ONLY_VALUES)."""
    if _ONLY_VALUE_NAMES.isdisjoint(body):
        return  # the common line: none of them asked (a set test, once a line)
    for name, (allowed, why) in ONLY_VALUES.items():
        value = body.get(name)
        if value is None or value in allowed:
            continue
        if name in ("tools", "functions"):
            raise UnsupportedParameter(f"body.{name} is not supported: {why}", param=f"body.{name}")
        raise UnsupportedParameter(
            f"body.{name}={json.dumps(value)[:100]} is not supported: {why}",
            param=f"body.{name}",
            code="unsupported_value",
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
    """The line's sampling: the parameters SamplingSpec has fields for onto those (the
    job's where the line leaves one out), every other one into ``params`` as given."""
    values = defaults.model_dump(exclude={"choice", "json_schema", "regex", "params"})
    for key in ("temperature", "top_p", "seed", "truncate_prompt_tokens"):
        if body.get(key) is not None:
            values[key] = body[key]
    n = body.get("n")
    if (
        isinstance(n, int)
        and n > 1
        and body.get("temperature") is None
        and not values["temperature"]
    ):
        # n answers of greedy decoding would be one answer n times (vLLM refuses it):
        # a line asking for n without a temperature samples at OpenAI's default, 1.
        values["temperature"] = OPENAI_DEFAULT_TEMPERATURE
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        values["stop"] = [stop] if isinstance(stop, str) else stop or None
    params = dict(defaults.params or {})
    for name, value in body.items():
        if name in SAMPLING_FIELD_PARAMS or name in NOT_SAMPLING_PARAMS:
            continue
        if name in IGNORED_PARAMETERS or name in ONLY_VALUES or value is None:
            continue
        params[name] = value
    values["params"] = params or None
    try:
        return SamplingSpec.model_validate(values)
    except ValueError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc


def _short_hash(job_id: str, custom_id: str) -> str:
    """The id of a request's output or error line: the same for a custom id in every
    attempt and file of its job."""
    return hashlib.sha256(f"{job_id}\x1f{custom_id}".encode()).hexdigest()[:24]


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
    endpoint: ApiEndpoint = ApiEndpoint.CHAT_COMPLETIONS,
    choices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A succeeded request, as the OpenAI Batch API writes it to the output file: a
    ``chat.completion`` body, or a ``text_completion`` one for /v1/completions.
    ``choices`` (index, text, finish_reason, logprobs), when the request asked for ``n``
    of them or for logprobs, are all written; else the one ``text``."""
    key = _short_hash(job_id, custom_id)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    body: dict[str, Any]
    if endpoint is ApiEndpoint.COMPLETIONS:
        given = choices or [{"index": 0, "text": text, "finish_reason": finish_reason}]
        body = {
            "id": f"cmpl-{key}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "text": c.get("text") or "",
                    "index": c.get("index", n),
                    "finish_reason": c.get("finish_reason"),
                    "logprobs": c.get("logprobs"),
                }
                for n, c in enumerate(given)
            ],
            "usage": usage,
        }
        return _succeeded_line(key, custom_id, body)
    if choices:
        listed = [
            {
                "index": c.get("index", n),
                "message": {"role": "assistant", "content": c.get("text") or ""},
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
            }
            for n, c in enumerate(choices)
        ]
    else:
        # The common line, one choice, built directly: the write step makes one per
        # item (a cached shard's whole work, next to its read).
        listed = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text or ""},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ]
    body = {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": listed,
        "usage": usage,
    }
    return _succeeded_line(key, custom_id, body)


def _succeeded_line(key: str, custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{key}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
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


def result_line(
    spec: JobSpec,
    row: LedgerRow,
    *,
    vectors: list[bytes] | None = None,
    encoding: str = "float",
) -> dict[str, Any]:
    """A succeeded item's output line, from its ledger row: for /v1/embeddings, OpenAI's
    embedding list of its staged ``vectors`` in the line's ``encoding``; else its
    completion."""
    endpoint = spec.endpoint
    if endpoint is ApiEndpoint.EMBEDDINGS:
        return embedding_output_line(
            job_id=spec.job_id,
            custom_id=row.item_id,
            model=spec.model,
            vectors=vectors or [],
            encoding=encoding,
            prompt_tokens=row.prompt_tokens or 0,
        )
    result = row.result or {}
    return output_line(
        job_id=spec.job_id,
        custom_id=row.item_id,
        model=spec.model,
        text=result.get("text") or "",
        finish_reason=result.get("finish_reason"),
        prompt_tokens=row.prompt_tokens or 0,
        completion_tokens=row.completion_tokens or 0,
        created=int(row.finished_at.timestamp()) if row.finished_at else 0,
        endpoint=endpoint,
        choices=result.get("choices"),
    )


class ChatLines:
    """The output lines of one job's common chat completions (one choice, no
    logprobs: what :func:`result_line` makes of most ledger rows), encoded straight to
    JSON: the same bytes as that line's dict through
    :func:`llmbatch.formats.writers.write_jsonl` (a property test holds them equal), in
    about a third of the time. A cached shard's write step makes one per item, and
    the nested dicts and their encoding were its largest per-item cost.
    """

    def __init__(self, spec: JobSpec) -> None:
        self._job_id = spec.job_id
        # Only /v1/chat/completions lines have this shape; for others encode() says no.
        self._chat = spec.endpoint is ApiEndpoint.CHAT_COMPLETIONS
        self._model = _json(spec.model)

    def encode_into(self, buffer: bytearray, row: LedgerRow) -> bool:
        """Append the line of ``row`` (a succeeded item) and its newline to ``buffer``;
        False, appending nothing, when its line is not a common one."""
        result = row.result or {}
        text = result.get("text") or ""
        finish_reason = result.get("finish_reason")
        if (
            not self._chat
            or result.get("choices")
            or not isinstance(text, str)
            or not (finish_reason is None or isinstance(finish_reason, str))
        ):
            return False
        key = _short_hash(self._job_id, row.item_id).encode()
        prompt, completion = row.prompt_tokens or 0, row.completion_tokens or 0
        created = int(row.finished_at.timestamp()) if row.finished_at else 0
        buffer += b"".join(
            (
                b'{"id":"batch_req_', key, b'","custom_id":', _json(row.item_id),
                b',"response":{"status_code":200,"request_id":"req_', key,
                b'","body":{"id":"chatcmpl-', key,
                b'","object":"chat.completion","created":', b"%d" % created,
                b',"model":', self._model,
                b',"choices":[{"index":0,"message":{"role":"assistant","content":',
                _json(text), b'},"logprobs":null,"finish_reason":', _json(finish_reason),
                b'}],"usage":{"prompt_tokens":', b"%d" % prompt,
                b',"completion_tokens":', b"%d" % completion,
                b',"total_tokens":', b"%d" % (prompt + completion), b'}}},"error":null}\n',
            )
        )  # fmt: skip
        return True


_json = msgspec.json.encode


def dead_line(
    *,
    job_id: str,
    custom_id: str,
    error_class: ErrorClass | None,
    message: str | None,
    source: str | None,
) -> dict[str, Any]:
    """A dead request's error-file line: OpenAI's code and message for one that never
    ran (its batch expired or was cancelled), else its error class and message, with
    the input line it came from."""
    if error_class in NEVER_RAN:
        code, text = NEVER_RAN[error_class]
    else:
        code = str(error_class or "error")
        text = f"{message} ({source})" if source else str(message)
    line = error_line(job_id=job_id, custom_id=custom_id, code=code, message=text)
    if error_class in BAD_REQUEST:
        # A request its body made impossible is answered as the endpoint answers it: a
        # 400 with OpenAI's error body (the ``error`` field keeps llm-batch's class).
        key = _short_hash(job_id, custom_id)
        line["response"] = {
            "status_code": 400,
            "request_id": f"req_{key}",
            "body": {
                "error": {
                    "message": text,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": code,
                }
            },
        }
    return line


# Dead items whose request the endpoint would refuse with 400 (their body is at fault).
BAD_REQUEST = frozenset({ErrorClass.INVALID_REQUEST})


# --- validation of a whole batch file (the OpenAI Batch API's "validating") ------------

# Codes of a batch's ``errors.data`` entries, as OpenAI's Batch API names them.
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_METHOD = "invalid_method"
URL_MISMATCH = "url_mismatch"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MODEL_MISMATCH = "model_mismatch"
EMPTY_FILE = "empty_file"
TOO_MANY_TASKS = "too_many_tasks"
# Not OpenAI's (its limit is on the file): a line past the job's max_row_bytes.
LINE_TOO_LARGE = "line_too_large"
# Any other reason planning refuses the batch (an unsupported parameter on every line).
INVALID_REQUEST = "invalid_request"

# Error-file codes of requests that never ran, as OpenAI writes them.
BATCH_EXPIRED = "batch_expired"
BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
BATCH_CANCELLED = "batch_cancelled"
BATCH_CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
# The error classes of requests that never ran, as OpenAI's codes and messages.
NEVER_RAN: dict[ErrorClass, tuple[str, str]] = {
    ErrorClass.BATCH_EXPIRED: (BATCH_EXPIRED, BATCH_EXPIRED_MESSAGE),
    ErrorClass.BATCH_CANCELLED: (BATCH_CANCELLED, BATCH_CANCELLED_MESSAGE),
}

# A failed batch lists this many invalid lines one entry each (the first ones, by line);
# every invalid line after them is still named, in one entry per code that lists their
# line numbers as ranges ("lines 101-250, 300"): one systematic fault would otherwise
# give a million entries.
MAX_BATCH_ERRORS = 100
# Ranges one such entry keeps (bounded memory); lines past them are counted.
MAX_LINE_RANGES = 1000


class BatchError(BaseModel):
    """One entry of a failed batch's ``errors.data``, as OpenAI's Batch API has it;
    ``line`` is 1-based. The one declaration: the validator writes these, the ledger
    keeps them as JSON, and the HTTP API answers them."""

    model_config = ConfigDict(frozen=True)

    code: str
    line: int | None = None
    message: str
    param: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class _LineRanges:
    """Line numbers (ascending) as ranges, at most MAX_LINE_RANGES of them."""

    first: str  # the message of the first line of these, which all lines share the code of
    param: str | None
    ranges: list[list[int]] = field(default_factory=list)
    lines: int = 0
    uncounted: int = 0

    def add(self, line: int) -> None:
        self.lines += 1
        if self.ranges and self.ranges[-1][1] == line - 1:
            self.ranges[-1][1] = line
        elif len(self.ranges) < MAX_LINE_RANGES:
            self.ranges.append([line, line])
        else:
            self.uncounted += 1

    def error(self, code: str) -> BatchError:
        shown = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in self.ranges)
        rest = f", and {self.uncounted} lines after those" if self.uncounted else ""
        noun = "line" if self.lines == 1 else "lines"
        return BatchError(
            code=code,
            line=self.ranges[0][0],
            message=f"{self.lines} more {noun} with this error, as the first says "
            f"({self.first}): {noun} {shown}{rest}.",
            param=self.param,
        )


@dataclass
class BatchValidator:
    """Checks every line of a batch file, one at a time (:meth:`add`), with memory
    bounded by the number of requests (a 16-byte digest per custom_id)."""

    endpoint: ApiEndpoint
    model: str
    max_requests: int
    max_errors: int = MAX_BATCH_ERRORS
    errors: list[BatchError] = field(default_factory=list)
    requests: int = 0
    _seen: dict[bytes, int] = field(default_factory=dict)
    # Invalid lines past the first max_errors, by code (named by finish()).
    _more: dict[str, _LineRanges] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        """The file has too many requests: stop reading (the file is refused as such)."""
        return self.requests > self.max_requests

    def add(self, line: int, data: bytes | None, *, max_bytes: int) -> None:
        """Check the line numbered ``line``; ``data`` None means longer than ``max_bytes``."""
        self.requests += 1
        if self.requests > self.max_requests:
            self._error(
                TOO_MANY_TASKS,
                f"The batch input file has more than the maximum of {self.max_requests} requests.",
            )
            return
        if data is None:
            self._error(
                LINE_TOO_LARGE, f"This line is longer than the limit of {max_bytes} bytes.", line
            )
            return
        problem = self._check(data)
        if problem is not None:
            code, message, param = problem
            self._error(code, message, line, param)
            return

    def finish(self) -> list[BatchError]:
        """The errors found: the first ``max_errors`` invalid lines one entry each, then
        one entry per code naming the other lines; an empty file is an error too."""
        if self.requests == 0:
            self._error(EMPTY_FILE, "The batch input file is empty.")
        return self.errors + [more.error(code) for code, more in self._more.items()]

    def _error(
        self, code: str, message: str, line: int | None = None, param: str | None = None
    ) -> None:
        if len(self.errors) < self.max_errors or line is None:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))
            return
        # Past the entries kept one by one, the line is still named, by its code.
        self._more.setdefault(code, _LineRanges(first=message, param=param)).add(line)

    def _check(self, data: bytes) -> tuple[str, str, str | None] | None:
        try:
            request = json.loads(data)
        except ValueError:
            return INVALID_JSON_LINE, "This line is not parseable as valid JSON.", None
        if not isinstance(request, dict):
            return INVALID_JSON_LINE, "This line is not a JSON object.", None
        for name in ("custom_id", "method", "url", "body"):
            if request.get(name) is None:
                return MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{name}'.", name
        custom_id, body = request["custom_id"], request["body"]
        if not isinstance(custom_id, str) or not custom_id:
            return MISSING_REQUIRED_PARAMETER, "custom_id must be a non-empty string.", "custom_id"
        if not isinstance(body, dict):
            return MISSING_REQUIRED_PARAMETER, "body must be a JSON object.", "body"
        if str(request["method"]).upper() != "POST":
            return INVALID_METHOD, "The method of a batch request must be POST.", "method"
        if request["url"] != self.endpoint.value:
            return (
                URL_MISMATCH,
                f"The URL provided for this request does not match the batch endpoint "
                f"{self.endpoint.value}.",
                "url",
            )
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        first = self._seen.setdefault(digest, self.requests)
        if first != self.requests:
            return (
                DUPLICATE_CUSTOM_ID,
                "The custom_id for this request is a duplicate of another request. The "
                "custom_id parameter must be unique for each request in a batch.",
                "custom_id",
            )
        named = body.get("model")
        if named is not None and (
            not isinstance(named, str) or model_identity(named) != model_identity(self.model)
        ):
            shown = str(named)[:MODEL_NAME_CHARS]
            return (
                MODEL_MISMATCH,
                f"The model {shown!r} of this request does not match the batch's model "
                f"{self.model!r}.",
                "body.model",
            )
        return None


def embedding_output_line(
    *,
    job_id: str,
    custom_id: str,
    model: str,
    vectors: list[bytes],
    encoding: str,
    prompt_tokens: int,
) -> dict[str, Any]:
    """A succeeded /v1/embeddings request, as the OpenAI Batch API writes it.
    ``vectors`` are each input's little-endian float32 bytes, as staged; ``encoding``
    is the line's ``encoding_format`` (float arrays, or those bytes in base64)."""
    key = _short_hash(job_id, custom_id)
    data = [
        {
            "object": "embedding",
            "embedding": base64.b64encode(v).decode() if encoding == "base64" else floats(v),
            "index": index,
        }
        for index, v in enumerate(vectors)
    ]
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
