"""How the remote engine classes an endpoint's answers, the waits it reads from them,
and when failures that last pause a job: pure functions over status codes, headers,
bodies and counts."""

from __future__ import annotations

import json

import pytest

from llmbatch.contract.states import EndpointFault, ErrorClass
from llmbatch.remote import faults
from llmbatch.remote.faults import FaultPolicy, JobFaults
from llmbatch.remote.http import Verdict, backoff_s, classify, retry_after

SECRET = "sk-secret-123"


def _body(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


@pytest.mark.parametrize(
    ("status", "message", "verdict", "error_class"),
    [
        (200, None, Verdict.OK, None),
        (201, None, Verdict.OK, None),
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


@pytest.mark.parametrize(
    ("status", "raw", "verdict", "fault"),
    [
        (200, b"<html><body>It works!</body></html>", Verdict.RETRY, EndpointFault.UNUSABLE_ANSWER),
        (200, b'{"choices": [{"mess', Verdict.RETRY, EndpointFault.UNUSABLE_ANSWER),
        (429, _body("slow down"), Verdict.THROTTLED, EndpointFault.THROTTLED),
        (503, b"<html>busy</html>", Verdict.THROTTLED, EndpointFault.THROTTLED),
        (502, b"<html>bad gateway</html>", Verdict.RETRY, EndpointFault.SERVER_ERROR),
        (401, _body("invalid API key"), Verdict.REFUSED, EndpointFault.REFUSED),
        (400, _body("bad field"), Verdict.ITEM_DEAD, None),
    ],
)  # fmt: skip
def test_the_endpoints_faults_are_classed(
    status: int, raw: bytes, verdict: Verdict, fault: EndpointFault | None
) -> None:
    answer = classify(status, {}, raw, secret=SECRET)
    assert (answer.verdict, answer.fault) == (verdict, fault)
    if fault is EndpointFault.UNUSABLE_ANSWER:
        assert answer.message.startswith(f"HTTP {status} but the body is not JSON: ")


def test_unusable_answers_in_a_row_pause_a_job_and_an_answer_starts_again() -> None:
    jobs = JobFaults("fleet", FaultPolicy(max_unusable_answers=3))
    unusable = EndpointFault.UNUSABLE_ANSWER
    assert jobs.failed("a", unusable, "html") is None
    assert jobs.failed("a", unusable, "html") is None
    jobs.answered("a")  # a good answer between: the count starts again
    assert jobs.failed("a", unusable, "html") is None
    assert jobs.failed("b", unusable, "html") is None  # another job counts apart
    assert jobs.failed("a", unusable, "html") is None
    why = jobs.failed("a", unusable, "the body is not JSON")
    assert why is not None and "gave 3 unusable answers in a row" in why
    assert "UnusableAnswer: the body is not JSON" in why
    jobs.clear()  # an endpoint update or a resume
    assert jobs.failed("a", unusable, "html") is None


def test_requests_unanswered_for_long_pause_a_job_and_any_answer_starts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    jobs = JobFaults("fleet", FaultPolicy(pause_after_failing_s=60))
    refused = EndpointFault.UNREACHABLE
    assert jobs.failed("a", refused, "connection refused") is None
    now[0] += 59
    assert jobs.failed("a", EndpointFault.TIMEOUT, "no answer") is None
    # A 429 is an answer: the endpoint is there.
    assert jobs.failed("a", EndpointFault.THROTTLED, "HTTP 429") is None
    now[0] += 59
    assert jobs.failed("a", refused, "connection refused") is None
    now[0] += 60
    why = jobs.failed("a", EndpointFault.SERVER_ERROR, "HTTP 502: bad gateway")
    assert why is not None and "gave no answer for 60 s" in why
    assert "ServerError: HTTP 502: bad gateway" in why
    # 0: never paused for it.
    never = JobFaults("fleet", FaultPolicy(pause_after_failing_s=0))
    assert never.failed("a", refused, "x") is None
    now[0] += 10_000
    assert never.failed("a", refused, "x") is None


def test_a_retry_after_is_cut_to_the_cap() -> None:
    policy = FaultPolicy(max_retry_after_s=300)
    assert policy.capped_wait(100_000) == 300
    assert policy.capped_wait(7) == 7
