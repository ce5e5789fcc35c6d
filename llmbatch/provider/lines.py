"""The lines of a provider batch: requests out (OpenAI batch JSONL), answers back.

A request line's ``custom_id`` is the item id of the request's lead item (the one the
deduplicated items share an answer with). An answer line becomes the
:class:`~llmbatch.engine.requests.GenerationResult` the online engines produce, so
the generate step's :class:`~llmbatch.stages.record.Recorder` records it.
"""

from __future__ import annotations

import json

import msgspec

from llmbatch.contract.spec import SamplingSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.engine.requests import (
    GenerationRequest,
    GenerationResult,
    check_structured,
    prepare,
)
from llmbatch.formats.openai_output import BATCH_CANCELLED, BATCH_EXPIRED
from llmbatch.remote.engine import request_payload
from llmbatch.remote.http import classify

CHAT_URL = "/v1/chat/completions"

_decode = msgspec.json.Decoder().decode

NEVER_RAN_CODES = frozenset({BATCH_EXPIRED, BATCH_CANCELLED})


def request_line(
    custom_id: str,
    *,
    model: str,
    messages: list[dict[str, str]] | None,
    prompt: str | None,
    sampling: SamplingSpec,
) -> tuple[str, bytes] | str:
    """The batch endpoint URL and the JSONL line for one request (the body the remote
    engine would send online), or why a Batch API cannot take it (choice and regex
    constraints and prompt truncation are vLLM's, not OpenAI's)."""
    made = request_payload(
        GenerationRequest(
            request_id=custom_id, messages=messages, prompt=prompt, sampling=sampling
        ),
        model=model,
        vllm=False,
    )
    if isinstance(made, str):
        return made
    url = "/v1" + made[0]
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": made[1]}
    return url, json.dumps(line, ensure_ascii=False).encode() + b"\n"


def answer_result(
    line: bytes, *, request_id_of: dict[str, str], sampling_of: dict[str, SamplingSpec]
) -> GenerationResult | None:
    """The result an output or error file line holds for the request its ``custom_id``
    names (``request_id_of``: custom id -> the recorder's request id); None for a line
    naming no request of this batch, or for one that never ran."""
    data = _decode(line)
    custom_id = str(data.get("custom_id"))
    request_id = request_id_of.get(custom_id)
    if request_id is None:
        return None
    error = data.get("error")
    if error and error.get("code") in NEVER_RAN_CODES:
        # Not an answer: the batch expired or was cancelled first. The item stays with
        # the batch's lease, to be submitted again or dead-lettered as such.
        return None
    response = data.get("response") or {}
    status = int(response.get("status_code") or 0)
    if error or status != 200:
        if response.get("body") is not None and status:
            answer = classify(status, {}, json.dumps(response["body"]).encode(), secret="")
            message, error_class = answer.message, answer.error_class
        else:
            message = f"{(error or {}).get('code')}: {(error or {}).get('message')}"
            error_class = ErrorClass.INVALID_REQUEST
        return GenerationResult(
            request_id=request_id,
            error_class=error_class or ErrorClass.INVALID_REQUEST,
            error_message=f"provider batch: {message}"[:320],
        )
    body = response.get("body") or {}
    choice = (body.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    used = body.get("usage") or {}
    result = GenerationResult(
        request_id=request_id,
        text=text,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=int(used.get("prompt_tokens") or 0),
        completion_tokens=int(used.get("completion_tokens") or 0),
    )
    sampling = sampling_of[custom_id]
    if sampling.json_schema is not None:
        check_structured(result, sampling, prepare(sampling))
    return result
