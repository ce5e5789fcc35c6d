"""What the stages need of the worker they run in: its settings, the ledger pool,
object storage, the render processes, its slots for waiting on other shards' leads,
and the step (activity) a stage runs in. The activities' context is a
:class:`StageContext`; nothing here imports ``activities``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import asyncpg

from llmbatch.config import Settings
from llmbatch.dedup.waits import WaitSlots
from llmbatch.rendering.pool import RenderPool
from llmbatch.storage.base import ObjectStore


class StageContext(Protocol):
    """The worker's settings, ledger pool and object-store reads and writes."""

    settings: Settings
    pool: asyncpg.Pool

    async def read(self, uri: str) -> bytes: ...

    async def write(self, uri: str, data: bytes) -> None: ...


class PrepareContext(StageContext, Protocol):
    """And what a CPU worker's prepare step needs besides: the store of an input's URI,
    the render processes and the worker's slots for waiting on leads."""

    @property
    def store(self) -> Callable[[str], ObjectStore]: ...

    renders: RenderPool
    lead_waits: WaitSlots


@dataclass(frozen=True, slots=True)
class Step:
    """The step (a Temporal activity) a stage runs in, as far as a stage that waits
    needs it: how to heartbeat it, and its heartbeat timeout (None: it has none)."""

    beat: Callable[[], None]
    heartbeat_timeout_s: float | None
