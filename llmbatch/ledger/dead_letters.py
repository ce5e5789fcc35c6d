"""Dead letters in the ledger: a job's dead items, a shard that failed for good
(placeholders for rows never read), and the re-drive that makes dead items pending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from llmbatch.contract.dead_letters import DeadLetterEntry
from llmbatch.contract.messages import ShardCounts, TokenCounts
from llmbatch.contract.states import (
    ErrorClass,
    ItemStatus,
)
from llmbatch.ledger.db import TERMINAL, Database, transaction
from llmbatch.ledger.items import DeadItem, record_dead
from llmbatch.ledger.jobs import shard_counts


@dataclass(slots=True)
class Requeued:
    """What a dead-letter re-drive made pending again."""

    item_ids: list[str]
    shards: list[int]


async def dead_items(
    pool: Database, *, job_id: str, shard: int | None = None
) -> list[DeadLetterEntry]:
    """A job's dead letters (or one shard's), by shard and item id."""
    rows = await pool.fetch(
        """
        SELECT item_id, shard, error_class, error_message AS message, source, attempts
        FROM dead_letters WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2)
        ORDER BY shard, item_id
        """,
        job_id,
        shard,
    )
    return [DeadLetterEntry.model_validate(dict(r)) for r in rows]


async def requeue_dead(
    pool: Database,
    *,
    job_id: str,
    item_ids: Sequence[str] | None = None,
    error_classes: Sequence[ErrorClass] | None = None,
) -> Requeued:
    """Make dead items pending again (dead-letter re-drive): those of ``item_ids``
    and of ``error_classes``, or every dead item when neither is given.

    The one way out of a terminal status: the error is cleared, the dead letter
    deleted, and the attempt count kept as history.
    """
    if item_ids is not None and not item_ids and not error_classes:
        return Requeued(item_ids=[], shards=[])
    async with transaction(pool) as conn:
        # The job's row lock orders this against a purge (llmbatch.ledger.retention):
        # a purged job's rows are gone or going, and nothing of it runs again.
        purging = await conn.fetchval(
            "SELECT purge_started_at IS NOT NULL FROM jobs WHERE job_id = $1 FOR SHARE", job_id
        )
        if purging:
            return Requeued(item_ids=[], shards=[])
        rows = await _requeue(conn, job_id, item_ids, error_classes)
    return Requeued(
        item_ids=[r["item_id"] for r in rows], shards=sorted({r["shard"] for r in rows})
    )


async def _requeue(
    conn: Database,
    job_id: str,
    item_ids: Sequence[str] | None,
    error_classes: Sequence[ErrorClass] | None,
) -> list[asyncpg.Record]:
    return await conn.fetch(
        """
        WITH requeued AS (
            UPDATE items SET status = $4, lease_owner = NULL, error_class = NULL,
                             error_message = NULL, started_at = NULL, finished_at = NULL,
                             updated_at = now()
            WHERE job_id = $1 AND status = $5
              AND (($2::text[] IS NULL AND $3::text[] IS NULL)
                   OR item_id = ANY($2::text[]) OR error_class = ANY($3::text[]))
            RETURNING item_id, shard
        ), forgotten AS (
            DELETE FROM dead_letters AS d USING requeued AS r
            WHERE d.job_id = $1 AND d.item_id = r.item_id
            RETURNING 1
        )
        SELECT item_id, shard FROM requeued ORDER BY shard, item_id
        """,
        job_id,
        None if item_ids is None else list(item_ids),
        None if error_classes is None else list(error_classes),
        ItemStatus.PENDING,
        ItemStatus.DEAD,
    )


async def dead_letter_shard(
    pool: Database, *, job_id: str, shard: int, error_class: ErrorClass, error_message: str
) -> ShardCounts:
    """A shard failed for good: every item of it not finished yet becomes dead.

    When its rows were never read (no items registered), one placeholder item per
    planned row stands for them, so the job's counts still add up and a re-drive
    can bring them back. Returns the shard's counts afterwards.
    """
    async with transaction(pool) as conn:
        planned = await conn.fetchrow(
            "SELECT uri, first_row, row_count FROM shards WHERE job_id = $1 AND shard = $2",
            job_id,
            shard,
        )
        registered = await conn.fetchval(
            "SELECT count(*) FROM items WHERE job_id = $1 AND shard = $2", job_id, shard
        )
        if planned is not None and registered == 0 and planned["row_count"] > 0:
            count = int(planned["row_count"])
            ordinals = list(range(planned["first_row"], planned["first_row"] + count))
            await conn.execute(
                """
                INSERT INTO items (job_id, item_id, shard, ordinal, source, placeholder)
                SELECT $1, 'row-' || t.ordinal, $2, t.ordinal,
                       format('%s (row %s of %s in shard %s, never read)', $3::text, t.n, $4::text,
                              $2::int),
                       true
                FROM unnest($5::bigint[], $6::bigint[]) AS t(ordinal, n)
                ON CONFLICT (job_id, item_id) DO NOTHING
                """,
                job_id,
                shard,
                planned["uri"],
                str(count),
                ordinals,
                list(range(1, count + 1)),
            )
        unfinished = await conn.fetch(
            "SELECT item_id FROM items WHERE job_id = $1 AND shard = $2 "
            "AND status <> ALL($3::text[])",
            job_id,
            shard,
            TERMINAL,
        )
        marked = await record_dead(
            conn,
            job_id=job_id,
            lease_owner=None,
            items=[
                DeadItem(
                    item_id=r["item_id"],
                    shard=shard,
                    error_class=error_class,
                    error_message=error_message,
                    source=None,
                )
                for r in unfinished
            ],
        )
        counts = await shard_counts(conn, job_id=job_id, shards=[shard])
    empty = ShardCounts(succeeded=0, dead=0, tokens=TokenCounts())
    return counts.get(shard, empty).model_copy(update={"marked": marked})
