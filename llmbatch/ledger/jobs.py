"""A job's row and its plan in the ledger: created once, paused and resumed, finished
with its totals; its planned shards; and its items counted by status.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmbatch.contract.messages import ShardCounts, TokenCounts
from llmbatch.contract.states import (
    ItemStatus,
    JobState,
)
from llmbatch.ledger.db import Database


@dataclass(slots=True)
class PlannedShard:
    """A shard as planned: enough to account for its rows if they are never read."""

    shard: int
    uri: str
    first_row: int
    row_count: int
    first_line: int | None


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


async def planned_shards(pool: Database, *, job_id: str) -> list[int]:
    """The shard numbers of a job's plan, in order."""
    rows = await pool.fetch("SELECT shard FROM shards WHERE job_id = $1 ORDER BY shard", job_id)
    return [int(r["shard"]) for r in rows]


async def shards_unregistered(pool: Database, *, job_id: str, before: int) -> int:
    """How many of the job's planned shards before shard ``before`` have registered
    no item yet (their prepare step has not got that far)."""
    if before <= 0:
        return 0
    # A shard's first item in items_by_shard's order, for each earlier shard: a probe
    # of the index whatever the statistics say of the job (as an anti-join, or
    # without the order, the planner may read every item of the table for each).
    count = await pool.fetchval(
        """
        SELECT count(*) FROM shards AS s
        WHERE s.job_id = $1 AND s.shard < $2
          AND (SELECT 1 FROM items AS i WHERE i.job_id = $1 AND i.shard = s.shard
               ORDER BY i.ordinal LIMIT 1) IS NULL
        """,
        job_id,
        before,
    )
    return int(count or 0)


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


async def shard_counts(
    pool: Database, *, job_id: str, shards: Sequence[int]
) -> dict[int, ShardCounts]:
    """What each of ``shards`` has recorded so far (succeeded and dead items, and the
    succeeded ones' tokens), by shard; a shard with no item yet is left out.

    Live progress reads this for a job's running shards, as often as every second: it
    walks items_by_shard for those shards only, so it costs the shards' size, never
    the job's.
    """
    if not shards:
        return {}
    rows = await pool.fetch(
        """
        SELECT shard,
               count(*) FILTER (WHERE status = $3) AS succeeded,
               count(*) FILTER (WHERE status = $4) AS dead,
               coalesce(sum(prompt_tokens) FILTER (WHERE status = $3), 0) AS prompt,
               coalesce(sum(completion_tokens) FILTER (WHERE status = $3), 0) AS completion
        FROM items WHERE job_id = $1 AND shard = ANY($2::int[])
        GROUP BY shard
        """,
        job_id,
        list(shards),
        ItemStatus.SUCCEEDED,
        ItemStatus.DEAD,
    )
    return {
        int(r["shard"]): ShardCounts(
            succeeded=int(r["succeeded"]),
            dead=int(r["dead"]),
            tokens=TokenCounts(prompt=int(r["prompt"]), completion=int(r["completion"])),
        )
        for r in rows
    }


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
