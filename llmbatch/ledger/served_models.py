"""Which models GPU workers serve, recorded in Postgres (``served_models``).

Task queue names are hashed (``Settings.gpu_task_queue``), so Temporal alone cannot say
which model a queue is for: each GPU worker records (queue, model, task) at start and
refreshes it while it runs; readers (``GET /v1/models``) keep the rows whose queue has
pollers now, which says who is alive.

A row also says how the queue's workers use the result cache (:class:`CachePolicy`):
the prepare step answers cached requests with it before a shard reaches them.
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

# How often a running worker refreshes its row. A fresh row that is not stopped counts
# its worker as serving the queue (``llm-batch queues``), beside Temporal's pollers.
REFRESH_S = 60.0


# A row not refreshed for this long no longer speaks for its queue's cache: its worker
# stopped without clearing it (a SIGKILL), and the next one may serve other weights.
POLICY_FRESH_S = 2 * REFRESH_S


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How a queue's workers answer from the result cache: the fingerprint of their
    weights (None: nothing is cached), whether jobs that do not say use the cache
    (``Settings.cache``), and whether tenants share it
    (``Settings.cache_shared_across_tenants``)."""

    weights: str | None
    cache: bool
    shared: bool


@dataclass(frozen=True, slots=True)
class ServedQueue:
    """What a worker records of itself: the queue it polls, the model it serves there
    for ``task``, its ``identity`` (Temporal's), and how it uses the result cache."""

    task_queue: str
    model: str
    task: str
    identity: str
    policy: CachePolicy = CachePolicy(weights=None, cache=False, shared=False)


@dataclass(slots=True)
class ServedModel:
    """A model some GPU worker served (or serves) on ``task_queue``."""

    task_queue: str
    model: str
    task: str
    identity: str
    first_seen: datetime
    last_seen: datetime
    # When the worker that recorded the row last stopped (None: it has not).
    stopped_at: datetime | None

    def serving(self, now: datetime) -> bool:
        """Whether the row speaks for a running worker: refreshed lately, not stopped."""
        fresh = (now - self.last_seen).total_seconds() <= POLICY_FRESH_S
        return fresh and self.stopped_at is None


async def record_served_model(db: Database, served: ServedQueue) -> None:
    """Record (or refresh) what a worker says of itself."""
    policy = served.policy
    await db.execute(
        "INSERT INTO served_models (task_queue, model, task, identity, weights, cache, "
        "cache_shared) VALUES ($1, $2, $3, $4, $5, $6, $7) "
        "ON CONFLICT (task_queue) DO UPDATE SET model = excluded.model, task = excluded.task, "
        "identity = excluded.identity, weights = excluded.weights, cache = excluded.cache, "
        "cache_shared = excluded.cache_shared, last_seen = now(), stopped_at = NULL",
        served.task_queue,
        served.model,
        served.task,
        served.identity,
        policy.weights,
        policy.cache,
        policy.shared,
    )


async def cache_policy(db: Database, *, task_queue: str) -> CachePolicy | None:
    """How the workers of ``task_queue`` use the result cache, as the last of them to
    record it said within :data:`POLICY_FRESH_S`; None when no worker said so lately
    or the one that did has stopped (then only a worker decides, at generate)."""
    row = await db.fetchrow(
        "SELECT weights, cache, cache_shared FROM served_models WHERE task_queue = $1 "
        "AND weights IS NOT NULL AND last_seen > now() - make_interval(secs => $2)",
        task_queue,
        POLICY_FRESH_S,
    )
    if row is None:
        return None
    return CachePolicy(weights=row["weights"], cache=row["cache"], shared=row["cache_shared"])


async def mark_stopped(db: Database, *, task_queue: str, identity: str) -> None:
    """A stopping worker no longer serves its queue, and its weights no longer answer for
    it (if it was the last to record the row; another worker of the queue records its
    own at its next refresh)."""
    await db.execute(
        "UPDATE served_models SET weights = NULL, stopped_at = now() "
        "WHERE task_queue = $1 AND identity = $2",
        task_queue,
        identity,
    )


async def served_models(db: Database) -> list[ServedModel]:
    """Every recorded queue, by model then task."""
    rows = await db.fetch(
        "SELECT task_queue, model, task, identity, first_seen, last_seen, stopped_at "
        "FROM served_models ORDER BY model, task"
    )
    return [ServedModel(**dict(r)) for r in rows]


async def was_served(db: Database, *, task_queue: str) -> bool:
    """Whether a worker has ever served ``task_queue``: its model is declared, and work
    for it waits for a worker (scaled to zero) instead of being refused."""
    return bool(await db.fetchval("SELECT 1 FROM served_models WHERE task_queue = $1", task_queue))


@contextlib.asynccontextmanager
async def advertised(db: Database, served: ServedQueue) -> AsyncIterator[None]:
    """Record ``served`` now and refresh it every :data:`REFRESH_S` while the block runs;
    at its end, mark it stopped (:func:`mark_stopped`).

    A failed record is logged, never raised: the worker's job is generating, and the
    next refresh records it again.
    """

    async def record() -> None:
        try:
            await record_served_model(db, served)
        except Exception as exc:  # Postgres away for a while, or not migrated yet
            log.warning("could not record served model %s: %s", served.model, exc)

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
        try:
            await mark_stopped(db, task_queue=served.task_queue, identity=served.identity)
        except Exception as exc:  # the row goes stale by itself (POLICY_FRESH_S)
            log.warning("could not mark %s stopped: %s", served.task_queue, exc)
