"""The bounded, lazy request loop both engines share (no vLLM here, so the remote
worker does not import it): ``call`` on each request, at most ``max_in_flight`` at a
time, results in completion order, aborting what is in flight when closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

_Req = TypeVar("_Req", bound=BaseModel)


_Res = TypeVar("_Res")


async def run_many(
    call: Callable[[_Req], Awaitable[_Res]],
    requests: AsyncIterable[_Req] | Iterable[_Req],
    *,
    max_in_flight: int,
) -> AsyncGenerator[_Res, None]:
    """``call`` on each request, ``max_in_flight`` at a time, results in completion
    order: the loop :meth:`Engine.generate_many` and :meth:`Engine.embed_many` share."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    # A slot is freed when the consumer takes a result, not when the engine
    # finishes it, so a slow consumer also bounds what piles up in ``done``.
    slots = asyncio.Semaphore(max_in_flight)
    done: asyncio.Queue[_Res | BaseException | _End] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def run(request: _Req) -> None:
        try:
            done.put_nowait(await call(request))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # EngineDeadError and the unexpected
            done.put_nowait(exc)

    def submit(request: _Req) -> None:
        task = asyncio.create_task(
            run(request), name=f"engine {getattr(request, 'request_id', '')}"
        )
        running.add(task)
        task.add_done_callback(running.discard)

    async def feed() -> None:
        count = 0
        try:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    await slots.acquire()
                    submit(request)
                    count += 1
            else:
                for request in requests:
                    await slots.acquire()
                    submit(request)
                    count += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the source failed
            done.put_nowait(exc)
        done.put_nowait(_End(count))

    feeder = asyncio.create_task(feed(), name="engine feeder")
    total: int | None = None
    received = 0
    try:
        while total is None or received < total:
            item = await done.get()
            if isinstance(item, _End):
                total = item.count
                continue
            if isinstance(item, BaseException):
                raise item
            received += 1
            slots.release()
            yield item
    finally:
        feeder.cancel()
        for task in running:
            task.cancel()
        # Wait for the aborts, so the engine is free when we return.
        await asyncio.gather(feeder, *running, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class _End:
    count: int
