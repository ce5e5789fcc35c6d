"""An endpoint changed under running remote workers (issue 53, items 2 and 3): a huge
Retry-After is capped, shown in ``status`` with its cause, and lifted everywhere by
``endpoint update`` or ``resume``; limits added, changed or removed reach a worker
that started without them within seconds.

The endpoint is vLLM's own OpenAI server behind nginx; the one answer it cannot give
on demand, a 429 asking for 100,000 s, the gateway injects
(:class:`~tests.fixtures.openai_server.GatewayFault`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from llmbatch.remote.status import EndpointState, endpoint_state
from tests.fixtures.openai_server import HUGE_RETRY_AFTER_S, GatewayFault
from tests.fixtures.worker_processes import job_result
from tests.remote.conftest import RemoteCase, cli

pytestmark = pytest.mark.slow

# The default cap of a Retry-After (LLMBATCH_REMOTE_MAX_RETRY_AFTER_S).
CAP_S = 300


async def _eventually(check: Callable[[], Awaitable[Any]], *, within_s: float = 60) -> Any:
    """``check()``'s first truthy value, polled every 0.2 s."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.2)
    raise TimeoutError(f"not reached in {within_s:.0f} s")


async def _blocked(remote: RemoteCase, endpoint: str) -> EndpointState:
    async def check() -> EndpointState | None:
        state = await endpoint_state(remote.pool, endpoint)
        return state if state.blocked_s > 0 else None

    result: EndpointState = await _eventually(check)
    return result


def _status(remote: RemoteCase, job_id: str) -> tuple[str, dict[str, Any]]:
    text = cli(remote.settings, "status", job_id)
    data = cli(remote.settings, "status", job_id, "--json")
    assert text.returncode == 0 and data.returncode == 0, text.stderr + data.stderr
    return text.stdout, json.loads(data.stdout)


async def test_a_huge_retry_after_is_capped_shown_and_lifted_by_update_or_resume(
    remote: RemoteCase,
) -> None:
    gateway = remote.gateway
    gateway.reload(fault=GatewayFault.HUGE_RETRY_AFTER)
    endpoint = remote.endpoint("--max-concurrency", "4")
    first = remote.job(endpoint, [{"text": f"First {i}."} for i in range(8)], prefix="wait1")
    async with remote.workers(endpoint):
        handle = await remote.start(first)
        state = await _blocked(remote, endpoint)
        # Capped: the worker waits at most the cap, not the 28 hours asked.
        assert CAP_S - 30 < state.blocked_s <= CAP_S, state
        assert state.blocked_reason is not None
        assert f"Retry-After {HUGE_RETRY_AFTER_S} s, cut to {CAP_S} s" in state.blocked_reason
        assert "HTTP 429: rate limit exceeded" in state.blocked_reason
        # The server is healthy again, but the endpoint waits as it was asked to.
        gateway.reload(fault=None)
        # A new job on it sends nothing, and its status says why (it has no requests yet).
        second = remote.job(endpoint, [{"text": f"Second {i}."} for i in range(8)], prefix="wait2")
        second_handle = await remote.start(second)
        await asyncio.sleep(4)
        assert [s for _, s in gateway.requests("/chat/completions") if s == 200] == []
        text, data = await asyncio.to_thread(_status, remote, second.job_id)
        [shown] = data["remote"]["endpoints"]
        assert shown["endpoint"] == endpoint and shown["usage"] is None
        assert 0 < shown["now"]["blocked_s"] <= CAP_S
        assert f"Retry-After {HUGE_RETRY_AFTER_S} s" in shown["now"]["blocked_reason"]
        waiting = [line for line in text.splitlines() if f"endpoint {endpoint} now:" in line]
        assert len(waiting) == 1 and "waiting" in waiting[0], text
        assert f"Retry-After {HUGE_RETRY_AFTER_S} s" in waiting[0]
        assert f"llm-batch endpoint update {endpoint}" in waiting[0]
        shown_endpoint = cli(remote.settings, "endpoint", "show", endpoint)
        assert f"Retry-After {HUGE_RETRY_AFTER_S} s" in shown_endpoint.stdout
        assert "last error" in shown_endpoint.stdout and "Throttled" in shown_endpoint.stdout

        # `endpoint update` lifts it, in the row and in the running worker: both jobs end.
        lifted = await asyncio.to_thread(cli, remote.settings, "endpoint", "update", endpoint)
        assert lifted.returncode == 0 and "lifted its wait" in lifted.stdout, lifted.stdout
        updated_at = time.monotonic()
        summaries = await asyncio.wait_for(
            asyncio.gather(job_result(handle), job_result(second_handle)), 90
        )
        took = time.monotonic() - updated_at
        for spec, summary in zip((first, second), summaries, strict=True):
            remote.assert_exactly_once(spec, summary, 8)
        assert (await endpoint_state(remote.pool, endpoint)).blocked_s == 0

        # Again, lifted by `resume` of the job this time (pause first: resume needs it).
        gateway.reload(fault=GatewayFault.HUGE_RETRY_AFTER)
        third = remote.job(endpoint, [{"text": f"Third {i}."} for i in range(8)], prefix="wait3")
        third_handle = await remote.start(third)
        await _blocked(remote, endpoint)
        gateway.reload(fault=None)
        for command in ("pause", "resume"):
            done = await asyncio.to_thread(cli, remote.settings, command, third.job_id)
            assert done.returncode == 0, done.stdout + done.stderr
        summary = await asyncio.wait_for(job_result(third_handle), 90)
    remote.assert_exactly_once(third, summary, 8)
    print(f"Retry-After {HUGE_RETRY_AFTER_S} s: waited at most {CAP_S} s; an update ended "
          f"the wait and both jobs in {took:.1f} s")  # fmt: skip


def _arrivals(remote: RemoteCase, since: float) -> list[float]:
    return sorted(t for t, s in remote.gateway.requests("/chat/completions") if t >= since)


async def test_limits_added_changed_and_removed_reach_a_worker_started_without_one(
    remote: RemoteCase,
) -> None:
    endpoint = remote.endpoint()  # no limit
    rows = [{"text": f"Row {i}."} for i in range(8)]
    spans: dict[str, float] = {}
    async with remote.workers(endpoint):  # started with no limit

        async def run(name: str, *update: str) -> list[float]:
            command = ("endpoint", "update", endpoint, *update)
            done = await asyncio.to_thread(cli, remote.settings, *command)
            assert done.returncode == 0, done.stdout + done.stderr
            # The workers read the row every second: within a few seconds they have it.
            await asyncio.sleep(3)
            since = time.time()
            spec = remote.job(endpoint, rows, prefix=name)
            remote.assert_exactly_once(spec, await remote.run(spec, within_s=120), len(rows))
            times = _arrivals(remote, since)
            assert len(times) == len(rows)
            spans[name] = times[-1] - times[0]
            return times

        # Added: 120 a minute is 2 a second (the shared bucket's burst is one request).
        await run("added", "--rpm", "120")
        assert spans["added"] >= (len(rows) - 2) / 2.0, spans
        # Changed: 60 a minute, 1 a second.
        await run("changed", "--rpm", "60")
        assert spans["changed"] >= (len(rows) - 2) / 1.0, spans
        # Removed: all at once again.
        await run("removed", "--rpm", "0")
        assert spans["removed"] < 2.0, spans
    shown = cli(remote.settings, "endpoint", "show", endpoint)
    assert "no rate limit" in shown.stdout, shown.stdout
    print(f"{len(rows)} requests: {spans['added']:.1f} s at 120 rpm, {spans['changed']:.1f} s "
          f"at 60 rpm, {spans['removed']:.2f} s with no limit")  # fmt: skip
