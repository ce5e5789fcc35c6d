"""Stopping a worker process cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal


async def wait_for_stop_signal(also: asyncio.Event | None = None) -> None:
    """Return on SIGINT or SIGTERM, or as soon as ``also`` is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait())]
    if also is not None:
        waiters.append(asyncio.ensure_future(also.wait()))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
