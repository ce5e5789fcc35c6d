"""The result cache across jobs, in the ledger's Postgres: reproducible requests'
results by request and model weights (:func:`llmbatch.dedup.cache_key`).

Written when an item's generated result is recorded; read by jobs with the cache on;
``llm-batch cache stats`` and ``cache purge`` manage it. Ledger-style: plain async
functions, one set-based statement each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from llmbatch.ledger.db import Database


@dataclass(slots=True)
class CachedResult:
    """A result the cache holds, and the item of the job that generated it."""

    cache_key: str
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    job_id: str
    item_id: str


@dataclass(slots=True)
class NewEntry:
    """A generated result to keep: what it answers and who generated it."""

    cache_key: str
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    item_id: str


@dataclass(slots=True)
class ModelStats:
    """What the cache holds for one model and weights."""

    model: str
    weights: str
    entries: int
    hits: int
    oldest: datetime
    newest: datetime


async def lookup(
    db: Database, *, cache_keys: Sequence[str], uses: Sequence[int]
) -> dict[str, CachedResult]:
    """The cached results of ``cache_keys``; each hit's count goes up by its ``uses``
    (the items it answers)."""
    if not cache_keys:
        return {}
    rows = await db.fetch(
        """
        UPDATE result_cache AS c SET hits = c.hits + t.uses, last_hit_at = now()
        FROM unnest($1::text[], $2::int[]) AS t(cache_key, uses)
        WHERE c.cache_key = t.cache_key
        RETURNING c.cache_key, c.result, c.prompt_tokens, c.completion_tokens, c.job_id,
                  c.item_id
        """,
        list(cache_keys),
        list(uses),
    )
    return {r["cache_key"]: CachedResult(**dict(r)) for r in rows}


async def count_hits(db: Database, *, uses: Mapping[str, int]) -> None:
    """Count ``uses`` (items answered, by cache key) as hits of the entries held. Rows
    are locked in key order, so two shards counting the same keys never deadlock."""
    if not uses:
        return
    await db.execute(
        """
        WITH t AS (
            SELECT * FROM unnest($1::text[], $2::int[]) AS t(cache_key, uses)
        ), locked AS (
            SELECT c.cache_key FROM result_cache AS c JOIN t USING (cache_key)
            ORDER BY c.cache_key FOR UPDATE OF c
        )
        UPDATE result_cache AS c SET hits = c.hits + t.uses, last_hit_at = now()
        FROM t JOIN locked USING (cache_key)
        WHERE c.cache_key = t.cache_key
        """,
        list(uses),
        list(uses.values()),
    )


async def held(db: Database, *, cache_keys: Sequence[str]) -> set[str]:
    """Which of ``cache_keys`` the cache holds, counting no hit (an estimate's look)."""
    if not cache_keys:
        return set()
    rows = await db.fetch(
        "SELECT cache_key FROM result_cache WHERE cache_key = ANY($1::text[])", list(cache_keys)
    )
    return {r["cache_key"] for r in rows}


async def store(
    db: Database, *, model: str, weights: str, job_id: str, entries: Sequence[NewEntry]
) -> None:
    """Keep generated results; a key already held keeps its first result."""
    if not entries:
        return
    await db.execute(
        """
        INSERT INTO result_cache
            (cache_key, model, weights, result, prompt_tokens, completion_tokens, job_id,
             item_id)
        SELECT t.cache_key, $1, $2, t.result::jsonb, t.prompt_tokens, t.completion_tokens,
               $3, t.item_id
        FROM unnest($4::text[], $5::text[], $6::int[], $7::int[], $8::text[])
             AS t(cache_key, result, prompt_tokens, completion_tokens, item_id)
        ON CONFLICT (cache_key) DO NOTHING
        """,
        model,
        weights,
        job_id,
        [e.cache_key for e in entries],
        [json.dumps(e.result) for e in entries],
        [e.prompt_tokens for e in entries],
        [e.completion_tokens for e in entries],
        [e.item_id for e in entries],
    )


async def stats(db: Database) -> list[ModelStats]:
    """Entries, hits and age of the cache, per model and weights."""
    rows = await db.fetch(
        """
        SELECT model, weights, count(*) AS entries, coalesce(sum(hits), 0)::bigint AS hits,
               min(created_at) AS oldest, max(created_at) AS newest
        FROM result_cache GROUP BY model, weights ORDER BY model, weights
        """
    )
    return [ModelStats(**dict(r)) for r in rows]


async def purge(
    db: Database, *, older_than: timedelta | None = None, model: str | None = None
) -> int:
    """Delete entries created more than ``older_than`` ago and/or of ``model`` (every
    entry when neither is given); return how many."""
    status = await db.execute(
        """
        DELETE FROM result_cache
        WHERE ($1::interval IS NULL OR created_at < now() - $1::interval)
          AND ($2::text IS NULL OR model = $2)
        """,
        older_than,
        model,
    )
    return int(status.rsplit(" ", 1)[1])
