"""The endpoint's ``--batch-max-in-flight``: numbered slots in ``provider_batch_slots``.

A shard's submission takes a slot before it creates its provider batch and gives it
back when the batch ends. Both are keyed by the submission's batch token
(:func:`llmbatch.provider.book.token_of`): a retried take finds the slot it holds, a
retried release deletes nothing more. The unique ``(endpoint, slot)`` index is the
fence: two takers racing for one free number cannot both have it, whatever the
worker, job or shard.

Slots go first come, first served: a waiting row (slot NULL) began to wait at its
``created_at``, and a free slot is granted only to the endpoint's oldest waiter (or to
a token with no waiter before it). A row also names the workflow run that took it, so
a slot whose workflow was terminated (it runs no code, never releases) can be found
and freed: :func:`due_for_check` picks the rows to describe in Temporal and
:func:`free_closed` deletes those whose run was closed, fenced on that run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from llmbatch.ledger.db import Database

# How often one row is described in Temporal, at most, whoever asks: a terminated
# holder's slot is free within this (plus the next waiter's try), and N rows cost at
# most N describes a period however many shards wait.
CHECK_EVERY = timedelta(seconds=30)


async def take(
    pool: Database,
    *,
    token: str,
    endpoint: str,
    job_id: str,
    shard: int,
    max_in_flight: int,
    workflow_id: str | None,
    run_id: str | None,
) -> bool:
    """Take a slot of ``endpoint`` for ``token`` (or find the one it holds); False: none
    is free, or an older waiter comes first; the token's row waits (slot NULL) for
    ``status`` to show. ``workflow_id``/``run_id``: the run taking it (the latest run
    to try is the row's holder; None: nobody to check, the row is never freed for it)."""
    # Strictly first come, first served, although waiters try on workflow timers up to a
    # minute apart (a tenth of their wait so far): a freed slot may stay idle until the
    # oldest waiter's next try, at most a minute and at most a tenth of what it has
    # waited, against batches that run for minutes to a day. Letting a later shard take
    # it meanwhile would let shards that try often (the new ones, a second apart)
    # overtake the one that has waited longest for ever, which is the starvation this
    # order exists to end. Waking the oldest waiter at once would need a signal, a
    # workflow change; a waiter whose workflow closed is removed by free_closed.
    try:
        slot = await pool.fetchval(
            """
            WITH me AS (
                SELECT COALESCE((SELECT created_at FROM provider_batch_slots
                                 WHERE token = $1), now()) AS since
            )
            INSERT INTO provider_batch_slots AS s
                (token, endpoint, job_id, shard, slot, taken_at, workflow_id, run_id)
            SELECT $1, $2, $3, $4, free.n, CASE WHEN free.n IS NULL THEN NULL ELSE now() END,
                   $6, $7
            FROM (SELECT (SELECT n FROM generate_series(0, $5 - 1) AS n
                          WHERE NOT EXISTS (SELECT 1 FROM provider_batch_slots o
                                            WHERE o.endpoint = $2 AND o.slot = n)
                            -- a limit lowered below the slots held waits for them
                            AND (SELECT count(*) FROM provider_batch_slots o
                                 WHERE o.endpoint = $2 AND o.slot IS NOT NULL) < $5
                            -- first come, first served: no waiter of the endpoint
                            -- began to wait before this token
                            AND NOT EXISTS (SELECT 1 FROM provider_batch_slots w, me
                                            WHERE w.endpoint = $2 AND w.slot IS NULL
                                              AND w.token <> $1
                                              AND (w.created_at, w.token) < (me.since, $1))
                          ORDER BY n LIMIT 1) AS n) AS free
            ON CONFLICT (token) DO UPDATE
               SET slot = COALESCE(s.slot, EXCLUDED.slot),
                   taken_at = COALESCE(s.taken_at, EXCLUDED.taken_at),
                   workflow_id = EXCLUDED.workflow_id,
                   run_id = EXCLUDED.run_id
            RETURNING slot
            """,
            token,
            endpoint,
            job_id,
            shard,
            max_in_flight,
            workflow_id,
            run_id,
        )
    except asyncpg.UniqueViolationError:
        return False  # another taker had the same free number first: try again later
    return slot is not None


@dataclass(frozen=True, slots=True)
class Holder:
    """A row of an endpoint's slots (held or waiting) and the workflow run that wrote
    it; ``workflow_id`` is None for a row from before 0014 that has not tried since."""

    token: str
    workflow_id: str | None
    run_id: str | None


async def due_for_check(pool: Database, *, endpoint: str, token: str) -> list[Holder]:
    """The endpoint's other rows, held or waiting, not described in Temporal for
    :data:`CHECK_EVERY`, marked as described now (so concurrent takers split them)."""
    rows = await pool.fetch(
        """
        UPDATE provider_batch_slots
        SET checked_at = now()
        WHERE endpoint = $1 AND token <> $2 AND workflow_id IS NOT NULL
          AND (checked_at IS NULL OR checked_at < now() - $3::interval)
        RETURNING token, workflow_id, run_id
        """,
        endpoint,
        token,
        CHECK_EVERY,
    )
    return [Holder(r["token"], r["workflow_id"], r["run_id"]) for r in rows]


async def free_closed(pool: Database, closed: list[Holder]) -> list[str]:
    """Delete the rows of ``closed`` (runs found closed), each only while the run that
    was described still holds it: a new run that took the token meanwhile keeps it.
    Returns the tokens freed."""
    rows = await pool.fetch(
        """
        DELETE FROM provider_batch_slots s
        USING unnest($1::text[], $2::text[]) AS c(token, run_id)
        WHERE s.token = c.token AND s.run_id IS NOT DISTINCT FROM c.run_id
        RETURNING s.token
        """,
        [h.token for h in closed],
        [h.run_id for h in closed],
    )
    return [r["token"] for r in rows]


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
