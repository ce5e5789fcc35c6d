"""The item ledger in Postgres: one row per (job, item), the source of truth for "done".

Status goes ``pending → running → succeeded | dead`` and a terminal status never
changes (except through :func:`requeue_dead`, the dead-letter re-drive). Writes are
batched through ``unnest`` arrays, one statement per batch, and fenced by lease: a
result lands only while the writer's ``lease_owner`` still holds the item, so an
attempt that outlived its heartbeat timeout cannot overwrite a newer one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

from llmbatch.contract.dead_letters import DeadLetterEntry
from llmbatch.contract.messages import ShardCounts, TokenCounts, Usage
from llmbatch.contract.states import (
    TERMINAL_STATUSES,
    ErrorClass,
    ItemStatus,
    JobState,
    ResultSource,
)

# Bound as a text[] parameter wherever SQL asks "finished?".
TERMINAL = [str(s) for s in TERMINAL_STATUSES]

# Every function takes a pool, or a connection when the caller wants several calls
# in one transaction of its own.
Database: TypeAlias = asyncpg.Pool | asyncpg.Connection


@dataclass(slots=True)
class NewItem:
    """An item to register: ``ordinal`` is its position in the input (output order)."""

    item_id: str
    ordinal: int
    prompt_hash: str | None
    source: str


@dataclass(slots=True)
class PlannedShard:
    """A shard as planned: enough to account for its rows if they are never read."""

    shard: int
    uri: str
    first_row: int
    row_count: int
    first_line: int | None


@dataclass(slots=True)
class Registered:
    """What registering a shard's items found: ids already finished, and ids that
    another shard of the job registered first (a repeated item id)."""

    done: set[str]
    elsewhere: set[str]


@dataclass(slots=True)
class Requeued:
    """What a dead-letter re-drive made pending again."""

    item_ids: list[str]
    shards: list[int]


@dataclass(slots=True)
class ItemResult:
    """A successful generation; ``result`` holds text, parsed output, finish reason."""

    item_id: str
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    result_source: ResultSource = ResultSource.GENERATED
    shared_with: str | None = None


@dataclass(slots=True)
class DeadItem:
    """An item that can never succeed, and why."""

    item_id: str
    shard: int
    error_class: ErrorClass
    error_message: str
    source: str | None


@dataclass(slots=True)
class LedgerRow:
    """One item as the ledger has it, for writing output."""

    item_id: str
    ordinal: int
    status: ItemStatus
    attempt: int
    source: str | None
    result: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_ms: float | None
    error_class: ErrorClass | None
    error_message: str | None
    finished_at: datetime | None
    result_source: ResultSource | None = None
    shared_with: str | None = None


@dataclass(slots=True)
class JobCounts:
    """Items per status for a job, and the tokens spent on those that succeeded."""

    total: int
    pending: int
    running: int
    succeeded: int
    dead: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def tokens(self) -> TokenCounts:
        return TokenCounts(prompt=self.prompt_tokens, completion=self.completion_tokens)


@asynccontextmanager
async def _transaction(db: Database) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            yield conn
    else:
        async with db.transaction():  # a savepoint inside the caller's transaction
            yield db


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections read and write jsonb as Python objects."""
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection
    )
    assert pool is not None
    return pool


async def upsert_job(
    pool: Database, *, job_id: str, spec: dict[str, Any], model: str, output_uri: str
) -> bool:
    """Record a job once; True when this call created it."""
    status = await pool.execute(
        "INSERT INTO jobs (job_id, spec, model, output_uri) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (job_id) DO NOTHING",
        job_id,
        spec,
        model,
        output_uri,
    )
    return status.endswith(" 1")


async def finish_job(
    pool: Database,
    *,
    job_id: str,
    status: JobState,
    items_total: int,
    items_succeeded: int,
    items_dead: int,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    """Record a job's outcome and totals."""
    await pool.execute(
        "UPDATE jobs SET status = $2, items_total = $3, items_succeeded = $4, items_dead = $5, "
        "prompt_tokens = $6, completion_tokens = $7, finished_at = now(), updated_at = now() "
        "WHERE job_id = $1",
        job_id,
        status,
        items_total,
        items_succeeded,
        items_dead,
        prompt_tokens,
        completion_tokens,
    )


async def record_shards(pool: Database, *, job_id: str, shards: Sequence[PlannedShard]) -> None:
    """Record a job's planned shards once (a re-planned job keeps the first plan)."""
    if not shards:
        return
    await pool.execute(
        """
        INSERT INTO shards (job_id, shard, uri, first_row, row_count, first_line)
        SELECT $1, t.shard, t.uri, t.first_row, t.row_count, t.first_line
        FROM unnest($2::int[], $3::text[], $4::bigint[], $5::bigint[], $6::int[])
             AS t(shard, uri, first_row, row_count, first_line)
        ON CONFLICT (job_id, shard) DO NOTHING
        """,
        job_id,
        [s.shard for s in shards],
        [s.uri for s in shards],
        [s.first_row for s in shards],
        [s.row_count for s in shards],
        [s.first_line for s in shards],
    )


async def register_items(
    pool: Database, *, job_id: str, shard: int, items: Sequence[NewItem]
) -> Registered:
    """Insert pending rows for new items; report those already finished and those
    another shard holds (which this shard must not run).

    Placeholders of the shard (rows a failed attempt never read) give way to the
    real items here, and their dead letters go with them.
    """
    if not items:
        return Registered(done=set(), elsewhere=set())
    ids = [i.item_id for i in items]
    async with _transaction(pool) as conn:
        await conn.execute(
            """
            WITH gone AS (
                DELETE FROM items WHERE job_id = $1 AND shard = $2 AND placeholder
                RETURNING item_id
            )
            DELETE FROM dead_letters AS d USING gone
            WHERE d.job_id = $1 AND d.item_id = gone.item_id
            """,
            job_id,
            shard,
        )
        await conn.execute(
            """
            INSERT INTO items (job_id, item_id, shard, ordinal, prompt_hash, source)
            SELECT $1, t.item_id, $2, t.ordinal, t.prompt_hash, t.source
            FROM unnest($3::text[], $4::bigint[], $5::text[], $6::text[])
                 AS t(item_id, ordinal, prompt_hash, source)
            ON CONFLICT (job_id, item_id) DO UPDATE
                SET prompt_hash = EXCLUDED.prompt_hash, updated_at = now()
                WHERE items.shard = EXCLUDED.shard AND items.status <> ALL($7::text[])
            """,
            job_id,
            shard,
            ids,
            [i.ordinal for i in items],
            [i.prompt_hash for i in items],
            [i.source for i in items],
            TERMINAL,
        )
        # A concurrent shard inserting the same id waits on the key, then finds it taken.
        rows = await conn.fetch(
            "SELECT item_id, shard <> $3 AS elsewhere FROM items "
            "WHERE job_id = $1 AND item_id = ANY($2::text[]) "
            "AND (shard <> $3 OR status = ANY($4::text[]))",
            job_id,
            ids,
            shard,
            TERMINAL,
        )
    return Registered(
        done={r["item_id"] for r in rows if not r["elsewhere"]},
        elsewhere={r["item_id"] for r in rows if r["elsewhere"]},
    )


async def claim_items(
    pool: Database,
    *,
    job_id: str,
    item_ids: Sequence[str],
    lease_owner: str,
    activity: str | None = None,
    attempt: int | None = None,
) -> set[str]:
    """Take the unfinished ones of ``item_ids`` for ``lease_owner``; return those taken.

    With ``activity`` and ``attempt`` (the Temporal activity and its attempt number),
    items that a newer attempt of the same activity holds are left alone: a stale
    attempt that starts late must not take them back.
    """
    if not item_ids:
        return set()
    rows = await pool.fetch(
        """
        UPDATE items SET status = $6, lease_owner = $3, lease_activity = $4,
                         lease_attempt = $5, attempt = attempt + 1,
                         started_at = now(), updated_at = now()
        WHERE job_id = $1 AND item_id = ANY($2::text[]) AND status <> ALL($7::text[])
          AND NOT (status = $6 AND $4::text IS NOT NULL AND lease_activity = $4
                   AND lease_attempt > $5)
        RETURNING item_id
        """,
        job_id,
        list(item_ids),
        lease_owner,
        activity,
        attempt,
        ItemStatus.RUNNING,
        TERMINAL,
    )
    return {r["item_id"] for r in rows}


async def record_results(
    pool: Database, *, job_id: str, lease_owner: str, results: Sequence[ItemResult]
) -> int:
    """Mark items succeeded where ``lease_owner`` still holds them; return rows written."""
    if not results:
        return 0
    status = await pool.execute(
        """
        UPDATE items AS i
        SET status = $8, result = r.result::jsonb, prompt_tokens = r.prompt_tokens,
            completion_tokens = r.completion_tokens, latency_ms = r.latency_ms,
            result_source = r.result_source, shared_with = r.shared_with,
            error_class = NULL, error_message = NULL, finished_at = now(), updated_at = now()
        FROM unnest($3::text[], $4::text[], $5::int[], $6::int[], $7::float8[], $10::text[],
                    $11::text[])
             AS r(item_id, result, prompt_tokens, completion_tokens, latency_ms, result_source,
                  shared_with)
        WHERE i.job_id = $1 AND i.item_id = r.item_id
          AND i.lease_owner = $2 AND i.status = $9
        """,
        job_id,
        lease_owner,
        [r.item_id for r in results],
        [json.dumps(r.result) for r in results],
        [r.prompt_tokens for r in results],
        [r.completion_tokens for r in results],
        [r.latency_ms for r in results],
        ItemStatus.SUCCEEDED,
        ItemStatus.RUNNING,
        [str(r.result_source) for r in results],
        [r.shared_with for r in results],
    )
    return int(status.rsplit(" ", 1)[1])


async def record_dead(
    pool: Database, *, job_id: str, lease_owner: str | None, items: Sequence[DeadItem]
) -> int:
    """Mark items dead and list them as dead letters; return rows marked.

    With a ``lease_owner`` only items it holds change (like results); without one,
    any unfinished item does (rows that failed before anything claimed them).
    """
    if not items:
        return 0
    count = await pool.fetchval(
        """
        WITH d AS (
            SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[])
                AS t(item_id, error_class, error_message, source)
        ), marked AS (
            UPDATE items AS i
            SET status = $7, error_class = d.error_class, error_message = d.error_message,
                source = COALESCE(d.source, i.source), finished_at = now(), updated_at = now()
            FROM d
            WHERE i.job_id = $1 AND i.item_id = d.item_id
              AND i.status <> ALL($8::text[])
              AND ($6::text IS NULL OR (i.lease_owner = $6 AND i.status = $9))
            RETURNING i.item_id, i.shard, i.error_class, i.error_message, i.source, i.attempt
        ), listed AS (
            INSERT INTO dead_letters
                (job_id, item_id, shard, error_class, error_message, source, attempts)
            SELECT $1, item_id, shard, error_class, error_message, source, attempt FROM marked
            ON CONFLICT (job_id, item_id) DO UPDATE
                SET error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message,
                    attempts = EXCLUDED.attempts, created_at = now(), redriven_at = NULL
            RETURNING 1
        )
        SELECT count(*) FROM marked
        """,
        job_id,
        [i.item_id for i in items],
        [i.error_class for i in items],
        [i.error_message for i in items],
        [i.source for i in items],
        lease_owner,
        ItemStatus.DEAD,
        TERMINAL,
        ItemStatus.RUNNING,
    )
    return int(count)


async def shard_results(pool: Database, *, job_id: str, shard: int) -> list[LedgerRow]:
    """Every item of a shard, in input order."""
    rows = await pool.fetch(
        """
        SELECT item_id, ordinal, status, attempt, source, result, prompt_tokens,
               completion_tokens, latency_ms, error_class, error_message, finished_at,
               result_source, shared_with
        FROM items WHERE job_id = $1 AND shard = $2 ORDER BY ordinal, item_id
        """,
        job_id,
        shard,
    )
    return [
        LedgerRow(
            **{
                **dict(r),
                "status": ItemStatus(r["status"]),
                "error_class": r["error_class"] and ErrorClass(r["error_class"]),
                "result_source": r["result_source"] and ResultSource(r["result_source"]),
            }
        )
        for r in rows
    ]


async def items_by_id(
    pool: Database, *, job_id: str, item_ids: Sequence[str]
) -> dict[str, LedgerRow]:
    """The ledger rows of ``item_ids`` (those the job has), by item id."""
    rows = await pool.fetch(
        """
        SELECT item_id, ordinal, status, attempt, source, result, prompt_tokens,
               completion_tokens, latency_ms, error_class, error_message, finished_at
        FROM items WHERE job_id = $1 AND item_id = ANY($2::text[])
        """,
        job_id,
        list(item_ids),
    )
    return {
        r["item_id"]: LedgerRow(
            **{
                **dict(r),
                "status": ItemStatus(r["status"]),
                "error_class": r["error_class"] and ErrorClass(r["error_class"]),
            }
        )
        for r in rows
    }


async def planned_shards(pool: Database, *, job_id: str) -> list[int]:
    """The shard numbers of a job's plan, in order."""
    rows = await pool.fetch("SELECT shard FROM shards WHERE job_id = $1 ORDER BY shard", job_id)
    return [int(r["shard"]) for r in rows]


async def job_counts(pool: Database, *, job_id: str) -> JobCounts:
    """How many of a job's items are in each status, and the tokens of those that succeeded."""
    row = await pool.fetchrow(
        """
        SELECT count(*) AS total,
               count(*) FILTER (WHERE status = $2) AS pending,
               count(*) FILTER (WHERE status = $3) AS running,
               count(*) FILTER (WHERE status = $4) AS succeeded,
               count(*) FILTER (WHERE status = $5) AS dead,
               coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
               coalesce(sum(completion_tokens), 0) AS completion_tokens
        FROM items WHERE job_id = $1
        """,
        job_id,
        ItemStatus.PENDING,
        ItemStatus.RUNNING,
        ItemStatus.SUCCEEDED,
        ItemStatus.DEAD,
    )
    assert row is not None
    return JobCounts(**{k: int(v) for k, v in dict(row).items()})


@dataclass(slots=True)
class EmbeddingCounts:
    """The vectors of an embed job's succeeded items, and their dimension (None when
    there are none, or when items of one job differ, which OpenAI lines may ask)."""

    count: int
    dimensions: int | None


async def embedding_counts(pool: Database, *, job_id: str) -> EmbeddingCounts:
    """How many vectors a job's succeeded items hold (an OpenAI line may hold several)
    and of what dimension, from the vector locations the ledger keeps."""
    row = await pool.fetchrow(
        """
        SELECT coalesce(sum((result->>'count')::bigint), 0) AS count,
               min((result->>'dimensions')::int) AS low,
               max((result->>'dimensions')::int) AS high
        FROM items WHERE job_id = $1 AND status = $2 AND result ? 'vectors'
        """,
        job_id,
        ItemStatus.SUCCEEDED,
    )
    assert row is not None
    same = row["low"] is not None and row["low"] == row["high"]
    return EmbeddingCounts(count=int(row["count"]), dimensions=row["low"] if same else None)


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
    rows = await pool.fetch(
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
    return Requeued(
        item_ids=[r["item_id"] for r in rows], shards=sorted({r["shard"] for r in rows})
    )


async def dead_letter_shard(
    pool: Database, *, job_id: str, shard: int, error_class: ErrorClass, error_message: str
) -> ShardCounts:
    """A shard failed for good: every item of it not finished yet becomes dead.

    When its rows were never read (no items registered), one placeholder item per
    planned row stands for them, so the job's counts still add up and a re-drive
    can bring them back. Returns the shard's counts afterwards.
    """
    async with _transaction(pool) as conn:
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
        row = await conn.fetchrow(
            """
            SELECT count(*) FILTER (WHERE status = $3) AS succeeded,
                   count(*) FILTER (WHERE status = $4) AS dead,
                   coalesce(sum(prompt_tokens) FILTER (WHERE status = $3), 0)
                       AS prompt_tokens,
                   coalesce(sum(completion_tokens) FILTER (WHERE status = $3), 0)
                       AS completion_tokens
            FROM items WHERE job_id = $1 AND shard = $2
            """,
            job_id,
            shard,
            ItemStatus.SUCCEEDED,
            ItemStatus.DEAD,
        )
    assert row is not None
    return ShardCounts(
        succeeded=row["succeeded"],
        dead=row["dead"],
        tokens=TokenCounts(prompt=row["prompt_tokens"], completion=row["completion_tokens"]),
        marked=marked,
    )


async def set_job_paused(pool: Database, *, job_id: str, paused: bool) -> bool:
    """Set a job's paused flag (read by its running ``generate`` activities).

    Returns False when the job has no row yet (it is still being planned).
    """
    status = await pool.execute(
        "UPDATE jobs SET paused = $2, updated_at = now() WHERE job_id = $1", job_id, paused
    )
    return status.endswith(" 1")


async def job_paused(pool: Database, *, job_id: str) -> bool:
    """Whether a job is paused; a job without a row is not."""
    paused = await pool.fetchval("SELECT paused FROM jobs WHERE job_id = $1", job_id)
    return bool(paused)


async def release_items(
    pool: Database,
    *,
    job_id: str,
    lease_owner: str,
    item_ids: Sequence[str],
    refund: bool = False,
) -> int:
    """Give back the items ``lease_owner`` still holds (status ``pending`` again); return
    how many. Used when an attempt is cancelled, so its unfinished items are not left
    ``running`` with nobody working on them. With ``refund`` (a drained worker gives
    them back) the claim is not counted as an attempt of theirs."""
    if not item_ids:
        return 0
    status = await pool.execute(
        """
        UPDATE items SET status = $4, lease_owner = NULL, started_at = NULL,
                         attempt = CASE WHEN $6 THEN greatest(attempt - 1, 0) ELSE attempt END,
                         updated_at = now()
        WHERE job_id = $1 AND item_id = ANY($3::text[]) AND lease_owner = $2
          AND status = $5
        """,
        job_id,
        lease_owner,
        list(item_ids),
        ItemStatus.PENDING,
        ItemStatus.RUNNING,
        refund,
    )
    return int(status.rsplit(" ", 1)[1])


# --- in-job deduplication: one leader per distinct request --------------------------


@dataclass(slots=True)
class Lead:
    """Who generates a distinct request of a job, and how far it is: ``result`` is
    set once the leader item succeeded."""

    request_key: str
    item_id: str
    result: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None


async def take_leads(
    pool: Database,
    *,
    job_id: str,
    leads: Sequence[tuple[str, str]],
    lease_owner: str,
    stale_after_s: float,
) -> set[str]:
    """Lead the requests of ``leads`` (request key, the item that will generate it) for
    ``lease_owner``; return the keys it now leads.

    A key is taken when nobody leads it, when this lease already does, or when its
    lead is gone: the leader item has not succeeded, and it no longer runs under the
    lead's lease (its attempt died and the item was released, re-claimed or marked
    dead) or the lead was not renewed for ``stale_after_s``. Fenced in the WHERE clause, so of
    two shards asking at once exactly one leads.
    """
    if not leads:
        return set()
    rows = await pool.fetch(
        """
        INSERT INTO dedup_leads AS l (job_id, request_key, item_id, lease_owner)
        SELECT $1, t.request_key, t.item_id, $2
        FROM unnest($3::text[], $4::text[]) AS t(request_key, item_id)
        ON CONFLICT (job_id, request_key) DO UPDATE
            SET item_id = EXCLUDED.item_id, lease_owner = EXCLUDED.lease_owner,
                renewed_at = now()
            WHERE l.lease_owner = EXCLUDED.lease_owner
               OR NOT EXISTS (
                   SELECT 1 FROM items AS i
                   WHERE i.job_id = l.job_id AND i.item_id = l.item_id
                     AND (i.status = $6
                          OR (i.status = $7 AND i.lease_owner = l.lease_owner
                              AND l.renewed_at >= now() - make_interval(secs => $5))))
        RETURNING request_key
        """,
        job_id,
        lease_owner,
        [k for k, _ in leads],
        [i for _, i in leads],
        stale_after_s,
        ItemStatus.SUCCEEDED,
        ItemStatus.RUNNING,
    )
    return {r["request_key"] for r in rows}


async def renew_leads(pool: Database, *, job_id: str, lease_owner: str) -> int:
    """Tell waiting shards that ``lease_owner``'s leads are alive; return how many."""
    status = await pool.execute(
        "UPDATE dedup_leads SET renewed_at = now() WHERE job_id = $1 AND lease_owner = $2",
        job_id,
        lease_owner,
    )
    return int(status.rsplit(" ", 1)[1])


async def leads(pool: Database, *, job_id: str, request_keys: Sequence[str]) -> dict[str, Lead]:
    """The current leads of ``request_keys``, with the leader's result where it has one."""
    if not request_keys:
        return {}
    rows = await pool.fetch(
        """
        SELECT l.request_key, l.item_id,
               CASE WHEN i.status = $3 THEN i.result END AS result,
               i.prompt_tokens, i.completion_tokens
        FROM dedup_leads AS l
        JOIN items AS i ON i.job_id = l.job_id AND i.item_id = l.item_id
        WHERE l.job_id = $1 AND l.request_key = ANY($2::text[])
        """,
        job_id,
        list(request_keys),
        ItemStatus.SUCCEEDED,
    )
    return {r["request_key"]: Lead(**dict(r)) for r in rows}


async def forget_leads(pool: Database, *, job_id: str) -> None:
    """Drop a finished job's leads (its items keep who shared with whom); a re-drive
    that comes later leads afresh."""
    await pool.execute("DELETE FROM dedup_leads WHERE job_id = $1", job_id)


# --- engine usage: GPU time and cost ------------------------------------------------


async def record_usage(
    pool: Database,
    *,
    job_id: str,
    shard: int,
    lease_owner: str,
    requests: int,
    busy_s: float,
    gpus: int,
    gpu_hour_price: float | None,
) -> None:
    """Record (or bring up to date) one generate attempt's engine work."""
    await pool.execute(
        """
        INSERT INTO engine_usage
            (job_id, shard, lease_owner, requests, busy_s, gpus, gpu_hour_price)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT (job_id, lease_owner) DO UPDATE
            SET requests = EXCLUDED.requests, busy_s = EXCLUDED.busy_s, updated_at = now()
        """,
        job_id,
        shard,
        lease_owner,
        requests,
        busy_s,
        gpus,
        gpu_hour_price,
    )


async def usage(pool: Database, *, job_id: str, shard: int | None = None) -> Usage:
    """A job's (or one shard's) result sources, engine requests, GPU-seconds and cost,
    as the ledger has them now."""
    row = await pool.fetchrow(
        """
        WITH sources AS (
            SELECT count(*) FILTER (WHERE coalesce(result_source, $3) = $3) AS generated,
                   count(*) FILTER (WHERE result_source = $4) AS deduplicated,
                   count(*) FILTER (WHERE result_source = $5) AS cached,
                   coalesce(sum(prompt_tokens) FILTER (WHERE result_source <> $3), 0)
                       AS reused_prompt,
                   coalesce(sum(completion_tokens) FILTER (WHERE result_source <> $3), 0)
                       AS reused_completion
            FROM items
            WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2) AND status = $6
        ), engine AS (
            SELECT coalesce(sum(requests), 0) AS requests,
                   coalesce(sum(busy_s * gpus), 0) AS gpu_seconds,
                   sum(busy_s * gpus * gpu_hour_price / 3600.0) AS cost
            FROM engine_usage WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2)
        )
        SELECT * FROM sources, engine
        """,
        job_id,
        shard,
        ResultSource.GENERATED,
        ResultSource.DEDUPLICATED,
        ResultSource.CACHED,
        ItemStatus.SUCCEEDED,
    )
    assert row is not None
    return Usage(
        generated=row["generated"],
        deduplicated=row["deduplicated"],
        cached=row["cached"],
        reused_tokens=TokenCounts(prompt=row["reused_prompt"], completion=row["reused_completion"]),
        engine_requests=row["requests"],
        gpu_seconds=float(row["gpu_seconds"]),
        cost=None if row["cost"] is None else float(row["cost"]),
    )
