"""A worker's drain: what its engine activities do between a stop signal and exit.

A worker told to stop (SIGTERM from a spot notice, a scale-down or a deploy) has a
drain timeout: Temporal's graceful shutdown timeout, after which the SDK cancels
whatever still runs. Inside that window an engine activity stops claiming and
submitting, lets the requests in flight finish, and, shortly before the window
closes, aborts what is still in flight, so it has time left to record what came
back and give the rest back before the SDK's cancel would come.

One :class:`Drain` per worker process, shared by its activities; begun by the
process's signal handler or by the SDK's own worker-shutdown notice, whichever
comes first; hurried (deadline now) by a second signal. The generate stage's engine
loop (:mod:`llmbatch.stages.generate`) is what watches it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from datetime import timedelta
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from llmbatch.contract.states import FailureType

_T = TypeVar("_T")

# What an activity keeps of the window for itself after aborting: abort, record,
# give back and report take well under a second; a fifth of the window, at most 5 s.
RESERVE_FRACTION = 0.2
RESERVE_MAX_S = 5.0


class Drain:
    """When the worker's drain began and when its activities must stop waiting."""

    def __init__(self, *, timeout: timedelta) -> None:
        self.timeout = timeout
        self._began: float | None = None
        self._stop_at: float | None = None
        self._began_event = asyncio.Event()
        # Replaced on every change of the deadline, so waiters see each change once.
        self._changed = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self._began is not None

    @property
    def stop_at(self) -> float | None:
        """``time.monotonic()`` by which in-flight work is aborted; None before the drain."""
        return self._stop_at

    @property
    def past_deadline(self) -> bool:
        """Whether the drain's deadline has passed (in-flight work is aborted by then)."""
        return self._stop_at is not None and time.monotonic() >= self._stop_at

    def begin(self) -> None:
        """Start the drain now (idempotent: the first call fixes the deadline)."""
        if self._began is not None:
            return
        now = time.monotonic()
        window = self.timeout.total_seconds()
        reserve = min(window * RESERVE_FRACTION, RESERVE_MAX_S)
        self._began, self._stop_at = now, now + max(window - reserve, 0.0)
        self._began_event.set()
        self._notify()

    def hurry(self) -> None:
        """Abort in-flight work now (a second stop signal): as a worker without drain."""
        self.begin()
        self._stop_at = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_begun(self) -> None:
        await self._began_event.wait()

    def next_change(self) -> asyncio.Event:
        """An event set at the next change of the deadline (take it before reading it)."""
        return self._changed

    def seconds_since_begun(self) -> float:
        return 0.0 if self._began is None else time.monotonic() - self._began


async def watch(drain: Drain, deadline: asyncio.Timeout) -> None:
    """Begin ``drain`` when the SDK says the worker shuts down (if nothing began it
    before), then keep ``deadline`` (around an activity's engine loop) at its deadline.
    Run in a task of the activity, cancelled when the loop ends."""
    shutdown = asyncio.ensure_future(activity.wait_for_worker_shutdown())
    begun = asyncio.ensure_future(drain.wait_begun())
    try:
        await asyncio.wait([shutdown, begun], return_when=asyncio.FIRST_COMPLETED)
    finally:
        shutdown.cancel()
        begun.cancel()
    drain.begin()
    loop = asyncio.get_running_loop()
    while not deadline.expired():
        changed = drain.next_change()
        stop_at = drain.stop_at
        if stop_at is not None:
            # asyncio's clock is time.monotonic(); the offset keeps it exact elsewhere.
            deadline.reschedule(loop.time() + (stop_at - time.monotonic()))
        await changed.wait()


async def unless_draining(drain: Drain, step: Awaitable[object]) -> bool:
    """Await ``step`` unless the drain begins first (then ``step`` is cancelled);
    return whether it ran to its end."""
    if drain.draining:
        if asyncio.iscoroutine(step):
            step.close()
        return False
    task = asyncio.ensure_future(step)
    begun = asyncio.ensure_future(drain.wait_begun())
    try:
        await asyncio.wait([task, begun], return_when=asyncio.FIRST_COMPLETED)
    finally:
        begun.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        task.result()  # its exception, if any
        return True
    return False


async def finish_before_cancel(step: Awaitable[_T]) -> _T:
    """Await ``step``; a cancel that comes meanwhile waits for it to end, then goes on.

    A ledger write cut half-way by the drain deadline would lose results the engine
    already produced; this lets the write finish first.
    """
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


def drained(message: str) -> ApplicationError:
    """The failure a drained attempt ends with: retried on another worker, not an
    error of the job (benign: the SDK does not log it as one)."""
    return ApplicationError(
        f"{FailureType.WORKER_DRAINED}: {message}",
        type=FailureType.WORKER_DRAINED,
        # The retry goes to whichever worker polls next; no backoff for a stop.
        next_retry_delay=timedelta(seconds=1),
        category=ApplicationErrorCategory.BENIGN,
    )
