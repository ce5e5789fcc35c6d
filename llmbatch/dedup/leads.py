"""The SQL of in-job deduplication: one leader per distinct request of a job.

A shard leads a request key (its item generates it) or waits for the leader's
result; a lead whose attempt died is taken over. Fenced in the WHERE clause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmbatch.contract.states import (
    ItemStatus,
)
from llmbatch.ledger.db import Database


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
