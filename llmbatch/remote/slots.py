"""A worker's requests in flight to an endpoint, at most ``max_concurrency``: a
semaphore whose size an ``endpoint update`` may change while requests wait on it."""

from __future__ import annotations

import asyncio
from types import TracebackType


class Slots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting = 0
        self._freed = asyncio.Condition()

    async def __aenter__(self) -> None:
        if self.used < self.limit and not self._waiting:  # the usual case: no lock taken
            self.used += 1
            return
        async with self._freed:
            self._waiting += 1
            try:
                await self._freed.wait_for(lambda: self.used < self.limit)
            finally:
                self._waiting -= 1
            self.used += 1

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.used -= 1
        async with self._freed:
            self._freed.notify()

    async def resize(self, limit: int) -> None:
        """A new size: more room lets waiting requests go now; less waits for some to end."""
        self.limit = limit
        async with self._freed:
            self._freed.notify_all()
