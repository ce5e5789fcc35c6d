"""The drain's timing inside an activity, in Temporal's ActivityEnvironment: the SDK's
worker-shutdown notice begins it, the deadline keeps a reserve of the window, a
second signal hurries it, and a ledger write is never cut half-way."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from temporalio.testing import ActivityEnvironment

from llmbatch.stages.drain import Drain, finish_before_cancel, unless_draining, watch


async def _engine_loop(drain: Drain) -> float:
    """An activity's engine loop that would run for a minute: how long it ran."""
    started = time.monotonic()
    deadline = asyncio.timeout(None)
    try:
        async with deadline:
            watching = asyncio.create_task(watch(drain, deadline))
            try:
                await asyncio.sleep(60)
            finally:
                watching.cancel()
    except TimeoutError:
        assert deadline.expired()
    return time.monotonic() - started


async def test_the_sdks_shutdown_notice_begins_the_drain_and_keeps_a_reserve() -> None:
    drain = Drain(timeout=timedelta(seconds=2))
    env = ActivityEnvironment()
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, env.worker_shutdown)
    ran = await env.run(_engine_loop, drain)
    assert drain.draining
    # Notice at 0.5 s, then the window less its reserve (a fifth of 2 s): 2.1 s.
    assert 2.0 <= ran < 2.6, ran


async def test_a_second_signal_hurries_the_drain() -> None:
    drain = Drain(timeout=timedelta(seconds=30))
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, drain.begin)
    loop.call_later(0.6, drain.hurry)
    ran = await ActivityEnvironment().run(_engine_loop, drain)
    assert 0.5 <= ran < 1.5, ran


async def test_a_zero_drain_aborts_at_once() -> None:
    drain = Drain(timeout=timedelta(0))
    asyncio.get_running_loop().call_later(0.2, drain.begin)
    ran = await ActivityEnvironment().run(_engine_loop, drain)
    assert ran < 0.6, ran


async def test_submitting_stops_when_the_drain_begins() -> None:
    drain = Drain(timeout=timedelta(seconds=10))
    assert await unless_draining(drain, asyncio.sleep(0.01))
    asyncio.get_running_loop().call_later(0.2, drain.begin)
    started = time.monotonic()
    # A paused job's gate would wait for a long time: the drain ends the wait.
    assert not await unless_draining(drain, asyncio.sleep(60))
    assert time.monotonic() - started < 1
    # Once draining, nothing more is awaited.
    assert not await unless_draining(drain, asyncio.sleep(60))


async def test_a_cancel_waits_for_the_ledger_write_in_progress() -> None:
    written: list[str] = []

    async def write() -> None:
        await asyncio.sleep(0.5)
        written.append("results")

    task = asyncio.create_task(finish_before_cancel(write()))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert written == ["results"]


async def test_past_deadline_says_whether_in_flight_work_was_aborted() -> None:
    # A cancelled attempt reads it to say whether its requests were aborted.
    drain = Drain(timeout=timedelta(seconds=1))
    assert not drain.past_deadline
    drain.begin()
    assert not drain.past_deadline
    await asyncio.sleep(0.85)  # the window less its reserve (a fifth): 0.8 s
    assert drain.past_deadline
    hurried = Drain(timeout=timedelta(seconds=30))
    hurried.hurry()
    assert hurried.past_deadline
