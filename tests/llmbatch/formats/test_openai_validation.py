"""A whole OpenAI batch file checked before it runs: every fault with its line, code and param."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmbatch.contract.spec import ApiEndpoint
from llmbatch.formats.openai_validation import BatchValidator


def line(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


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
