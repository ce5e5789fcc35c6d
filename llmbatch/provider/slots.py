"""The endpoint's ``--batch-max-in-flight``: numbered slots in ``provider_batch_slots``.

A shard's submission takes a slot before it creates its provider batch and gives it
back when the batch ends. Both are keyed by the submission's batch token
(:func:`llmbatch.provider.book.token_of`): a retried take finds the slot it holds, a
retried release deletes nothing more. The unique ``(endpoint, slot)`` index is the
fence: two takers racing for one free number cannot both have it, whatever the
worker, job or shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from llmbatch.ledger.db import Database


async def take(
    pool: Database, *, token: str, endpoint: str, job_id: str, shard: int, max_in_flight: int
) -> bool:
    """Take a slot of ``endpoint`` for ``token`` (or find the one it holds); False: none
    is free, the token's row waits (slot NULL) for ``status`` to show."""
    try:
        slot = await pool.fetchval(
            """
            INSERT INTO provider_batch_slots AS s (token, endpoint, job_id, shard, slot, taken_at)
            SELECT $1, $2, $3, $4, free.n, CASE WHEN free.n IS NULL THEN NULL ELSE now() END
            FROM (SELECT (SELECT n FROM generate_series(0, $5 - 1) AS n
                          WHERE NOT EXISTS (SELECT 1 FROM provider_batch_slots o
                                            WHERE o.endpoint = $2 AND o.slot = n)
                            -- a limit lowered below the slots held waits for them
                            AND (SELECT count(*) FROM provider_batch_slots o
                                 WHERE o.endpoint = $2 AND o.slot IS NOT NULL) < $5
                          ORDER BY n LIMIT 1) AS n) AS free
            ON CONFLICT (token) DO UPDATE
               SET slot = COALESCE(s.slot, EXCLUDED.slot),
                   taken_at = COALESCE(s.taken_at, EXCLUDED.taken_at)
            RETURNING slot
            """,
            token,
            endpoint,
            job_id,
            shard,
            max_in_flight,
        )
    except asyncpg.UniqueViolationError:
        return False  # another taker had the same free number first: try again later
    return slot is not None


async def release(pool: Database, *, token: str) -> None:
    """Give the token's slot back (or stop its wait); a second release does nothing."""
    await pool.execute("DELETE FROM provider_batch_slots WHERE token = $1", token)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A shard of the job waiting for a slot of ``endpoint``."""

    shard: int
    endpoint: str
    in_flight: int


async def job_waiting(pool: Database, job_id: str) -> list[Waiting]:
    """The job's shards waiting for a provider batch slot, and what holds the slots."""
    rows = await pool.fetch(
        """
        SELECT w.shard, w.endpoint,
               (SELECT count(*) FROM provider_batch_slots o
                WHERE o.endpoint = w.endpoint AND o.slot IS NOT NULL) AS in_flight
        FROM provider_batch_slots w
        WHERE w.job_id = $1 AND w.slot IS NULL
        ORDER BY w.shard
        """,
        job_id,
    )
    return [Waiting(r["shard"], r["endpoint"], r["in_flight"]) for r in rows]
