"""Render processes: real child processes, each row under its time limit."""

from __future__ import annotations

import asyncio
import signal
import time

import psutil
import pytest

from llmbatch.contract.spec import ChatMessage
from llmbatch.rendering.limits import RenderLimits
from llmbatch.rendering.pool import KILL_GRACE_S, RenderPool
from llmbatch.rendering.templates import TemplateError

# Loops n * n times without output: only a time limit stops it.
RUNAWAY = [
    ChatMessage(
        role="user",
        content="{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}{{ n }}",
    )
]
LIMITS = RenderLimits(timeout_s=1.0, max_memory_bytes=256 << 20)


def _all_render_children() -> list[psutil.Process]:
    return [
        p for p in psutil.Process().children() if "llmbatch.rendering.pool" in " ".join(p.cmdline())
    ]


# Render children that are not the test's own: the session's in-process CPU worker
# keeps render processes of its own when other tests ran jobs in this process.
_OTHERS: set[int] = set()


@pytest.fixture(autouse=True)
def _others() -> None:
    _OTHERS.clear()
    _OTHERS.update(p.pid for p in _all_render_children())


def render_children() -> list[psutil.Process]:
    """The render processes this test's pool started."""
    return [p for p in _all_render_children() if p.pid not in _OTHERS]


async def test_a_runaway_row_dies_at_its_limit_and_the_rest_render() -> None:
    pool = RenderPool(LIMITS)
    try:
        rows = [{"n": 1}, {"n": 100_000}, {"n": 2}, {"n": 100_000}, {"n": 3}]
        started = time.monotonic()
        out = await pool.render(RUNAWAY, rows)
        took = time.monotonic() - started
    finally:
        pool.close()
    assert [o if isinstance(o, TemplateError) else o[0]["content"] for o in out][::2] == [
        "1",
        "2",
        "3",
    ]
    for dead in (out[1], out[3]):
        assert isinstance(dead, TemplateError)
        assert str(dead) == "message 0 (user): rendering took longer than the 1 s limit per row"
    assert took < 2 * (LIMITS.timeout_s + KILL_GRACE_S)


async def test_the_event_loop_turns_while_a_runaway_row_renders() -> None:
    pool = RenderPool(LIMITS)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.05)

    ticker = asyncio.create_task(tick())
    try:
        await pool.render(RUNAWAY, [{"n": 100_000}])
    finally:
        ticker.cancel()
        pool.close()
    assert ticks >= 10  # ~1 s of a 50 ms tick


async def test_a_row_stuck_past_the_childs_own_alarm_is_killed_with_its_child() -> None:
    # A test double for a row stuck inside one C call, which the child's alarm cannot
    # interrupt: the child is stopped (SIGSTOP) while it renders.
    pool = RenderPool(LIMITS)
    try:
        await pool.render(RUNAWAY, [{"n": 1}])  # a child started and idle: no start-up below
        [child] = render_children()
        render = asyncio.create_task(pool.render(RUNAWAY, [{"n": 100_000}, {"n": 7}]))
        await asyncio.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        out = await asyncio.wait_for(render, 3 * (LIMITS.timeout_s + KILL_GRACE_S))
    finally:
        pool.close()
    assert isinstance(out[0], TemplateError) and "took longer" in str(out[0])
    assert out[1] == [{"role": "user", "content": "7"}]  # rendered by a new child
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


async def test_a_huge_allocation_is_a_memory_error_not_the_oom_killer() -> None:
    pool = RenderPool(LIMITS)
    try:
        out = await pool.render(
            [ChatMessage(role="user", content="{{ text | center(n) }}")],
            [{"text": "a", "n": 1_000_000_000}, {"text": "b", "n": 3}],
        )
    finally:
        pool.close()
    assert isinstance(out[0], TemplateError) and "MemoryError" in str(out[0])
    assert out[1] == [{"role": "user", "content": " b "}]


async def test_cancelling_a_render_kills_its_child_at_once() -> None:
    pool = RenderPool(RenderLimits(timeout_s=600))
    await pool.render(RUNAWAY, [{"n": 1}])
    [child] = render_children()
    render = asyncio.create_task(pool.render(RUNAWAY, [{"n": 100_000}]))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    render.cancel()
    await asyncio.gather(render, return_exceptions=True)
    child.wait(5)
    assert time.monotonic() - started < 2
    assert not render_children()
    pool.close()


async def test_cancelling_while_a_child_starts_leaves_no_child() -> None:
    pool = RenderPool(LIMITS)
    render = asyncio.create_task(pool.render(RUNAWAY, [{"n": 1}]))
    await asyncio.sleep(0)  # the render has started its child (no wait before that)
    assert render_children()
    render.cancel()
    await asyncio.gather(render, return_exceptions=True)
    assert not render_children()
    pool.close()
