"""Stopping a worker process cleanly on SIGINT/SIGTERM: while it starts
(:class:`StoppableStart`) and once it polls (:func:`serve`)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any

import asyncpg
from botocore.exceptions import BotoCoreError
from temporalio.service import RPCError
from temporalio.worker import Worker

from llmbatch.errors import LlmBatchError
from llmbatch.stages.drain import Drain

# The signals that stop a worker: Kubernetes' and a supervisor's, and Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What signal.signal takes and gives back.
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StoppedWhileStarting(SystemExit):
    """A stop signal came before the worker polled, and its start was ended. A
    ``SystemExit`` (code 0), which asyncio and vLLM let through wherever it is raised,
    as they must for ``sys.exit``."""

    def __init__(self, received: signal.Signals) -> None:
        super().__init__(0)
        self.signal = received


class StoppableStart:
    """While the block runs (a worker's start: service checks, a model load), SIGINT or
    SIGTERM ends the start: ``end`` is called (the GPU worker kills its engine's
    processes, which ends a load at once: vLLM's EngineCore only notes a SIGTERM until
    it is built), then :class:`StoppedWhileStarting` is raised where the main thread
    is. A model load blocks the event loop, so a loop's signal handler would run only
    once the model had loaded; this one runs inside the load. Further signals while the
    start ends are ignored. Once the worker polls, :func:`serve`'s handlers take over.

    ``signal`` says which signal ended the start (None: none did), so that the caller
    can tell a stop from a failure whatever the interrupted code raised in the end."""

    def __init__(self, *, end: Callable[[], None]) -> None:
        self.signal: signal.Signals | None = None
        self._end = end
        self._previous: dict[signal.Signals, _Handler] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            return
        self.signal = signal.Signals(signum)
        self._end()
        raise StoppedWhileStarting(self.signal)

    def __enter__(self) -> StoppableStart:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


async def wait_for_stop_signal(also: asyncio.Event | None = None) -> None:
    """Return on SIGINT or SIGTERM, or as soon as ``also`` is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait())]
    if also is not None:
        waiters.append(asyncio.ensure_future(also.wait()))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def _shut_down(worker: Worker, *, name: str, drain: Drain | None) -> None:
    """``worker.shutdown()``, draining first when it has a drain."""
    if drain is None:
        await worker.shutdown()
        return
    loop = asyncio.get_running_loop()

    def hurry() -> None:
        print(f"{name}: second stop signal, aborting in-flight work", flush=True)
        drain.hurry()

    print(f"{name} draining (up to {drain.timeout.total_seconds():g} s)", flush=True)
    drain.begin()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, hurry)
    try:
        await worker.shutdown()
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    print(f"{name} drained in {drain.seconds_since_begun():.1f} s", flush=True)


# How long the check at a clean stop waits for Temporal.
HEALTH_TIMEOUT = timedelta(seconds=5)


class ConnectionLost(LlmBatchError, RuntimeError):
    """A service went away while a worker ran or stopped; the message is one line."""


# What a lost Temporal, Postgres or S3 connection raises out of a running worker.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    RPCError,
    BotoCoreError,
)


def connection_lost(name: str, exc: BaseException) -> ConnectionLost:
    """The one line a worker stops with when a connection went away under it."""
    return ConnectionLost(
        f"{name} stopped: a connection was lost: {type(exc).__name__}: {one_line(exc)}"
    )


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (drivers' messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


async def serve(
    worker: Worker,
    *,
    name: str,
    ready: str,
    also: asyncio.Event | None = None,
    drain: Drain | None = None,
    started: Callable[[], None] | None = None,
    stopping: Callable[[], None] | None = None,
) -> None:
    """Run ``worker`` until SIGINT/SIGTERM or ``also``; print ``ready`` as it starts.

    A stop signal begins ``drain``: the worker polls no more, its activities have the
    worker's graceful shutdown timeout to finish or hand back; a second signal hurries
    them (in-flight work aborted and handed back at once). ``started`` is called once
    the worker runs, ``stopping`` when it is told to stop.

    ``worker.run()`` in a task of its own rather than ``async with worker``: when its
    polls fail while it shuts down (Temporal went away), the context manager cancels
    the task inside it and the failure is lost in a CancelledError; here it is the
    run task's own exception, raised as :class:`ConnectionLost`.
    """
    run = asyncio.create_task(worker.run())
    stop = asyncio.create_task(wait_for_stop_signal(also))
    print(ready, flush=True)
    if started is not None:
        started()
    try:
        await asyncio.wait([run, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if stopping is not None:
            stopping()
        if not run.done():
            await _shut_down(worker, name=name, drain=drain)
    try:
        await run
    except Exception as exc:
        # Its polls failed for good: Temporal went away or turned the worker down.
        raise ConnectionLost(
            f"{name} stopped: its Temporal worker failed: {one_line(exc.__cause__ or exc)}"
        ) from exc
    # A stop while Temporal is gone can still end cleanly: the SDK retries failed polls
    # for a while and a shutdown in that window raises nothing. Ask Temporal once, so
    # the exit code says whether the worker could hand its work back, whatever the timing.
    try:
        healthy = await worker.client.service_client.check_health(timeout=HEALTH_TIMEOUT)
    except Exception as exc:
        raise ConnectionLost(
            f"{name} stopped: Temporal at {worker.client.service_client.config.target_host}"
            f" is unreachable: {one_line(exc)}"
        ) from exc
    if not healthy:
        raise ConnectionLost(
            f"{name} stopped: Temporal at {worker.client.service_client.config.target_host}"
            " does not serve its workflow service"
        )
