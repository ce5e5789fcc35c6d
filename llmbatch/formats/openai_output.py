"""OpenAI batch output and error-file lines, as the OpenAI Batch API writes them: one
output line per succeeded request and one error-file line per failed request, matched
by ``custom_id``; a line's id is the same in every attempt and file of its job.

The lines' requests are :mod:`llmbatch.formats.openai_requests`.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import TYPE_CHECKING, Any

import msgspec

from llmbatch.contract.spec import ApiEndpoint, JobSpec
from llmbatch.contract.states import ErrorClass
from llmbatch.formats.vectors import floats

if TYPE_CHECKING:
    from llmbatch.ledger.items import LedgerRow


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

# Dead items whose request the endpoint would refuse with 400 (their body is at fault).
BAD_REQUEST = frozenset({ErrorClass.INVALID_REQUEST})

_json = msgspec.json.encode


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
    the number of the input line it came from (its ``source``)."""
    if error_class in NEVER_RAN:
        code, text = NEVER_RAN[error_class]
    else:
        code = str(error_class or "error")
        line_number = _line_number(source)
        text = f"{message} ({line_number})" if line_number else str(message)
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


# A line's source, as the readers name it: "<object>:line N" (llmbatch.formats.readers).
_SOURCE_LINE = re.compile(r":(line [0-9]+)$")


def _line_number(source: str | None) -> str | None:
    """The ``line N`` of a request's ``source``, not the object it was read from: an API
    batch's input file is an internal object whose address no message may name, and
    the line's ``custom_id`` already says which request it is."""
    found = _SOURCE_LINE.search(source or "")
    return found.group(1) if found else None


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
