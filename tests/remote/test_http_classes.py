"""How the remote engine classes an endpoint's answers, and the waits it reads from
them: pure functions over status codes, headers and bodies."""

from __future__ import annotations

import json

import pytest

from llmbatch.contract.states import ErrorClass
from llmbatch.remote.http import Verdict, backoff_s, classify, retry_after

SECRET = "sk-secret-123"


def _body(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


@pytest.mark.parametrize(
    ("status", "message", "verdict", "error_class"),
    [
        (200, None, Verdict.OK, None),
        (400, "This model's maximum context length is 512 tokens", Verdict.ITEM_DEAD,
         ErrorClass.PROMPT_TOO_LONG),
        (400, "temperature must be at most 2", Verdict.ITEM_DEAD, ErrorClass.INVALID_REQUEST),
        (422, "bad field", Verdict.ITEM_DEAD, ErrorClass.INVALID_REQUEST),
        (401, "invalid API key", Verdict.REFUSED, None),
        (403, "forbidden", Verdict.REFUSED, None),
        (404, "The model `x` does not exist.", Verdict.REFUSED, None),
        (429, "slow down", Verdict.THROTTLED, None),
        (503, "overloaded", Verdict.THROTTLED, None),
        (500, "boom", Verdict.RETRY, None),
        (502, "bad gateway", Verdict.RETRY, None),
        (408, "timeout", Verdict.RETRY, None),
    ],
)  # fmt: skip
def test_answers_are_classed_for_a_batch(
    status: int, message: str | None, verdict: Verdict, error_class: ErrorClass | None
) -> None:
    raw = b'{"choices": []}' if message is None else _body(message)
    answer = classify(status, {}, raw, secret=SECRET)
    assert answer.verdict is verdict
    assert answer.error_class is error_class


def test_messages_are_cut_short_and_never_hold_the_key() -> None:
    answer = classify(400, {}, _body(f"bad key {SECRET} " + "x" * 5000), secret=SECRET)
    assert SECRET not in answer.message
    assert len(answer.message) <= 320


def test_waits_come_from_retry_after_and_rate_limit_headers() -> None:
    assert retry_after({"Retry-After": "7"}) == 7.0
    assert retry_after({"retry-after-ms": "250"}) == 0.25
    assert (
        retry_after({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m30s"})
        == 90.0
    )
    assert retry_after(
        {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20ms"}
    ) == (pytest.approx(0.02))
    # A window that is not exhausted asks for no wait.
    assert (
        retry_after({"x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "1s"})
        is None
    )
    assert retry_after({}) is None


def test_backoff_is_full_jitter_capped_and_never_shorter_than_asked() -> None:
    waits = [backoff_s(3) for _ in range(200)]
    assert all(0 <= w <= 4.0 for w in waits) and max(waits) > 2.0  # spread over [0, 4]
    assert all(backoff_s(20) <= 10.0 for _ in range(50))
    assert backoff_s(0, floor_s=5.0) == 5.0
