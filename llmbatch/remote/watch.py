"""Each remote worker's view of its endpoint's row, read again every second.

An endpoint's options change under running workers (``endpoint update``: new limits,
a new base URL, prices), and its shared wait may be lifted (``endpoint update``,
``resume`` of a job). A worker reads the row every :data:`WATCH_EVERY_S`, whether
it sends or waits, and hands it to its engine, which applies what changed. One
small indexed read a second per engine: the hot path never touches the row.

The row's *generation* (its ``created_at`` and ``generation`` counter) says when the
waits held in memory must go: ``endpoint update`` and ``resume`` count it up, and so
does a ``remove`` and ``add`` of the same name (a new ``created_at``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from llmbatch.ledger.db import Database
from llmbatch.remote.endpoints import COLUMNS, Endpoint

log = logging.getLogger(__name__)

WATCH_EVERY_S = 1.0

_ROW_SQL = f"""
SELECT {COLUMNS}, generation, send_factor,
       greatest(extract(epoch FROM blocked_until - clock_timestamp())::float8, 0) AS blocked_s
  FROM endpoints WHERE name = $1
"""


@dataclass(frozen=True, slots=True)
class EndpointRow:
    """An endpoint's options and shared state, as read now."""

    endpoint: Endpoint
    generation: tuple[datetime | None, int]
    send_factor: float
    blocked_s: float


async def read_row(pool: Database, name: str) -> EndpointRow | None:
    """The endpoint's row now; None when it is no longer declared."""
    row = await pool.fetchrow(_ROW_SQL, name)
    if row is None:
        return None
    values = dict(row)
    generation = int(values.pop("generation"))
    send_factor = float(values.pop("send_factor"))
    blocked_s = float(values.pop("blocked_s"))
    endpoint = Endpoint.model_validate(values)
    return EndpointRow(
        endpoint=endpoint,
        generation=(endpoint.created_at, generation),
        send_factor=send_factor,
        blocked_s=blocked_s,
    )


class EndpointWatch:
    """Reads the endpoint's row every :data:`WATCH_EVERY_S` and calls ``on_row`` with
    it; a failed read (the database away) or a removed endpoint leaves the worker as
    it was."""

    def __init__(
        self, pool: Database, name: str, on_row: Callable[[EndpointRow], Awaitable[None]]
    ) -> None:
        self._pool, self._name, self._on_row = pool, name, on_row
        self._task: asyncio.Task[None] | None = None
        self._missing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"endpoint {self._name} watch")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            try:
                await self.refresh()
            except Exception as exc:  # the database away: read again next time
                log.debug("endpoint %s: row not read: %s", self._name, exc)

    async def refresh(self) -> None:
        row = await read_row(self._pool, self._name)
        if row is None:
            if not self._missing:
                log.warning(
                    "endpoint %s is no longer declared; this worker keeps its last options",
                    self._name,
                )
            self._missing = True
            return
        self._missing = False
        await self._on_row(row)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
