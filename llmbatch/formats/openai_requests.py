"""OpenAI batch JSONL request lines: ``{custom_id, method, url, body}`` into the
request llm-batch runs.

``url`` is /v1/chat/completions (or, in a batch of the OpenAI Batch API created for
that endpoint, /v1/completions) for generate jobs, or /v1/embeddings for embed jobs.
A line that cannot run raises :class:`InvalidRequest`: that line dies (a 400 in the
error file), the others run. The output and error lines are
:mod:`llmbatch.formats.openai_output`; checking a whole file before a batch runs is
:mod:`llmbatch.formats.openai_validation`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import (
    NOT_SAMPLING_PARAMS,
    SAMPLING_FIELD_PARAMS,
    ApiEndpoint,
    EmbedSpec,
    SamplingSpec,
)
from llmbatch.errors import LlmBatchError

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


class InvalidRequest(LlmBatchError, ValueError):
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


_json = msgspec.json.encode
