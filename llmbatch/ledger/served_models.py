"""Which models GPU workers serve, recorded in Postgres (``served_models``).

Task queue names are hashed (``Settings.gpu_task_queue``), so Temporal alone cannot say
which model a queue is for: each GPU worker records (queue, model, task) at start and
refreshes it while it runs; readers (``GET /v1/models``) keep the rows whose queue has
pollers now, which says who is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from llmbatch.ledger.db import Database

log = logging.getLogger(__name__)

# How often a running worker refreshes its row (last_seen is informational: liveness
# is Temporal's poller list).
REFRESH_S = 60.0


@dataclass(slots=True)
class ServedModel:
    """A model some GPU worker served (or serves) on ``task_queue``."""

    task_queue: str
    model: str
    task: str
    identity: str
    first_seen: datetime
    last_seen: datetime


async def record_served_model(
    db: Database, *, task_queue: str, model: str, task: str, identity: str
) -> None:
    """Record that a worker named ``identity`` serves ``model`` for ``task`` on ``task_queue``."""
    await db.execute(
        "INSERT INTO served_models (task_queue, model, task, identity) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (task_queue) DO UPDATE SET model = excluded.model, task = excluded.task, "
        "identity = excluded.identity, last_seen = now()",
        task_queue,
        model,
        task,
        identity,
    )


async def served_models(db: Database) -> list[ServedModel]:
    """Every recorded queue, by model then task."""
    rows = await db.fetch(
        "SELECT task_queue, model, task, identity, first_seen, last_seen "
        "FROM served_models ORDER BY model, task"
    )
    return [ServedModel(**dict(r)) for r in rows]


async def was_served(db: Database, *, task_queue: str) -> bool:
    """Whether a worker has ever served ``task_queue``: its model is declared, and work
    for it waits for a worker (scaled to zero) instead of being refused."""
    return bool(await db.fetchval("SELECT 1 FROM served_models WHERE task_queue = $1", task_queue))


@contextlib.asynccontextmanager
async def advertised(
    db: Database, *, task_queue: str, model: str, task: str, identity: str
) -> AsyncIterator[None]:
    """Record the model now and refresh it every :data:`REFRESH_S` while the block runs.

    A failed record is logged, never raised: the worker's job is generating, and the
    next refresh records it again.
    """

    async def record() -> None:
        try:
            await record_served_model(
                db, task_queue=task_queue, model=model, task=task, identity=identity
            )
        except Exception as exc:  # Postgres away for a while, or not migrated yet
            log.warning("could not record served model %s: %s", model, exc)

    async def refresh() -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await record()

    await record()

    task_ = asyncio.create_task(refresh())
    try:
        yield
    finally:
        task_.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task_
