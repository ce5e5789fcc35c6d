"""Ledger retention: purge a finished job's item rows and the rows that hang on them.

A purge deletes a job's ``items``, ``dead_letters``, ``shards`` and ``dedup_leads``
rows and keeps its ``jobs`` row (status, totals, tokens) and its engine and endpoint
usage (a few rows a job, its cost history). Its output in the object store is not the
ledger's and is never touched. Only a job in a final state is purged, and never while
a dead-letter re-drive runs items of it: the purge marks the job's row first
(``purge_started_at``), under the same row lock that a re-drive takes before it makes
dead items pending again (:func:`llmbatch.ledger.dead_letters.requeue_dead`).

Every delete goes by ``job_id``, the first column of each table's primary key, in
batches of :data:`PURGE_BATCH` rows a statement: the time is the job's, not the
table's, and no statement holds locks or WAL for long beside running jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from llmbatch.contract.states import FINAL_JOB_STATES, ItemStatus
from llmbatch.errors import LlmBatchError
from llmbatch.ledger.db import Database, transaction

# Rows deleted per statement.
PURGE_BATCH = 10_000

FINAL = [str(s) for s in FINAL_JOB_STATES]
UNFINISHED = [str(ItemStatus.PENDING), str(ItemStatus.RUNNING)]

# One statement per table, each a batch of the job's rows walked in the order of the
# primary key (job_id, key) from where the last batch ended, then deleted by their
# tuple ids (a TID scan): neither half depends on what the planner believes of the
# job, whose rows may be newer than the table's statistics. Measured beside 400,000
# rows of another job with stale statistics: deleting by key (= ANY of the batch)
# chose another index of the job and filtered each row against the whole batch, 7.2 s
# for 10,000 rows; a LIMIT without the ORDER BY scanned the table from its start.
# Tuple ids are exact here: the statement's snapshot keeps them from being reused,
# and a finished job's rows do not change. Table names cannot be bound parameters, so
# they are spelled out; each key starts below every real one (ids are never empty).
_DELETE_BATCH = {
    table: f"""
    WITH batch AS MATERIALIZED (
        SELECT ctid AS tid, {key} AS key FROM {table}
        WHERE job_id = $1 AND {key} > $2::{kind}
        ORDER BY job_id, {key} LIMIT $3
    ), gone AS (
        DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT tid FROM batch))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) AS count, (SELECT count(*) FROM batch) AS walked,
           (SELECT max(key) FROM batch) AS last
    """
    for table, key, kind in (
        ("items", "item_id", "text"),
        ("dead_letters", "item_id", "text"),
        ("shards", "shard", "int"),
        ("dedup_leads", "request_key", "text"),
    )
}
_FIRST_KEY: dict[str, object] = {"items": "", "dead_letters": "", "shards": -1, "dedup_leads": ""}


class NotPurgeable(LlmBatchError):
    """A job that must not be purged (unknown, not finished, or being re-driven)."""


@dataclass(slots=True)
class Purged:
    """What a purge removed from the ledger for one job."""

    job_id: str
    state: str
    finished_at: datetime | None
    items: int
    dead_letters: int
    shards: int
    dedup_leads: int


async def jobs_finished_before(pool: Database, *, before: datetime) -> list[str]:
    """The finished jobs not purged yet that ended before ``before``, oldest first."""
    rows = await pool.fetch(
        "SELECT job_id FROM jobs WHERE purged_at IS NULL AND finished_at IS NOT NULL "
        "AND finished_at < $1 AND status = ANY($2::text[]) ORDER BY finished_at, job_id",
        before,
        FINAL,
    )
    return [r["job_id"] for r in rows]


async def check_purgeable(pool: Database, *, job_id: str) -> None:
    """Raise :class:`NotPurgeable` when :func:`purge_job` would refuse the job now."""
    async with transaction(pool) as conn:
        await _hold_purgeable(conn, job_id)


async def purge_job(pool: Database, *, job_id: str, batch_size: int = PURGE_BATCH) -> Purged:
    """Delete a finished job's ledger rows (see the module); return how many of each.

    Raises :class:`NotPurgeable` for a job the ledger does not know, one not in a
    final state, or one with items a re-drive made pending since it finished. A purge
    that was cut off is finished by calling this again.
    """
    async with transaction(pool) as conn:
        job = await _hold_purgeable(conn, job_id)
        if job["purge_started_at"] is None:
            await conn.execute("UPDATE jobs SET purge_started_at = now() WHERE job_id = $1", job_id)
    counts = {
        table: await _delete_all(pool, sql, job_id, _FIRST_KEY[table], batch_size)
        for table, sql in _DELETE_BATCH.items()
    }
    await pool.execute(
        "UPDATE jobs SET purged_at = now(), updated_at = now() WHERE job_id = $1", job_id
    )
    return Purged(
        job_id=job_id,
        state=job["status"],
        finished_at=job["finished_at"],
        items=counts["items"],
        dead_letters=counts["dead_letters"],
        shards=counts["shards"],
        dedup_leads=counts["dedup_leads"],
    )


async def _hold_purgeable(conn: asyncpg.Connection, job_id: str) -> asyncpg.Record:
    """Lock the job's row (against a re-drive) and check it may be purged."""
    job = await conn.fetchrow(
        "SELECT status, finished_at, purge_started_at FROM jobs WHERE job_id = $1 FOR UPDATE",
        job_id,
    )
    if job is None:
        raise NotPurgeable(f"no job {job_id!r} in the ledger")
    if job["status"] not in FINAL:
        raise NotPurgeable(f"job {job_id!r} is {job['status']}: only finished jobs are purged")
    if job["purge_started_at"] is None:
        # Items pending or running since the job ended belong to a re-drive (a cancel's
        # leftovers were released before the end was recorded).
        # Walked in the primary key's order, so it stays on the job's rows in the index.
        redriven = await conn.fetchval(
            "SELECT item_id FROM items WHERE job_id = $1 AND status = ANY($2::text[]) "
            "AND updated_at > coalesce($3, '-infinity'::timestamptz) "
            "ORDER BY job_id, item_id LIMIT 1",
            job_id,
            UNFINISHED,
            job["finished_at"],
        )
        if redriven is not None:
            raise NotPurgeable(
                f"job {job_id!r} has items in a dead-letter re-drive (item {redriven!r} "
                "among them): purge it once the re-drive is done"
            )
    return job


async def _delete_all(pool: Database, sql: str, job_id: str, first: object, batch_size: int) -> int:
    deleted, last = 0, first
    while True:
        row = await pool.fetchrow(sql, job_id, last, batch_size)
        assert row is not None
        deleted += row["count"]
        if row["walked"] < batch_size:  # the walk reached the job's end
            return deleted
        last = row["last"]
