"""The SQL of in-job deduplication: one leader per distinct request of a job.

A shard leads a request key (its item generates it) or waits for the leader's
result; a lead whose attempt died is taken over. Registering a shard answers its
items from the job's succeeded leads and the result cache, and leads the requests it
leaves pending until its generate step takes them over (:data:`REGISTER_ANSWERS`, the
part of :func:`llmbatch.ledger.items.register_items`'s statement that is dedup's;
``REGISTERED_LEAD``). A shard whose every request another shard leads waits for them
at prepare (:func:`lead_progress`), and is answered by registering or, when it
registered first, by :func:`answer_from_leads`. Fenced in the WHERE clause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmbatch.contract.states import (
    ItemStatus,
    ResultSource,
)
from llmbatch.ledger.db import THIS_JOB, Database, batch_rows
from llmbatch.ledger.items import Answered, Answering, AnswerSql

# The lease owner of a lead that registering took (see REGISTER_ANSWERS): no attempt's
# lease, so any generate attempt takes it over, and other shards wait for it only a
# while (:func:`lead_progress`).
REGISTERED_LEAD = "registered"

# How registering a shard's items answers them in its one statement: from the job's
# succeeded lead of an item's request (``lead_key``: its request key) first, a result
# of this job, else from the result cache's entry of its ``cache_key``; written as a
# generate attempt would have recorded them: ``deduplicated`` and the leader's (or
# entry's) item id when the result is this job's own, else ``cached`` and
# ``job/item`` (or only ``result_cache`` when ``anonymous``: another tenant's entry is
# never named).
#
# And ``led``: a request left pending here is led by its first item here, unless the
# job leads it already: a shard registered after this one then waits for its result
# and registers answered (one write an item), where it would otherwise find no lead
# yet (this shard's generate step has not started), register pending and be answered
# by a second write. Only while the job has a shard planned after this one, which
# starts (and registers) later: the last shard's leads would keep nobody waiting, and
# cost a write each.
REGISTER_ANSWERS = AnswerSql(
    keys=("cache_key", "lead_key"),
    params=("deduplicated", "cached", "anonymous", "registered_lead"),
    answers="""
        SELECT t.item_id, t.ordinal, t.prompt_hash, t.source,
               coalesce(li.result, c.result) AS result,
               CASE WHEN li.item_id IS NOT NULL THEN li.prompt_tokens
                    ELSE c.prompt_tokens END AS prompt_tokens,
               CASE WHEN li.item_id IS NOT NULL THEN li.completion_tokens
                    ELSE c.completion_tokens END AS completion_tokens,
               CASE WHEN li.item_id IS NOT NULL OR c.job_id = {job_id} THEN {deduplicated}
                    WHEN c.cache_key IS NOT NULL THEN {cached} END AS result_source,
               CASE WHEN li.item_id IS NOT NULL THEN li.item_id
                    WHEN c.job_id = {job_id} THEN c.item_id
                    WHEN c.cache_key IS NULL THEN NULL
                    WHEN {anonymous} THEN 'result_cache'
                    ELSE c.job_id || '/' || c.item_id END AS shared_with
        FROM t
        LEFT JOIN dedup_leads AS l ON l.job_id = {this_job} AND l.request_key = t.lead_key
        LEFT JOIN items AS li
               ON li.job_id = {this_job} AND li.item_id = l.item_id AND li.status = {succeeded}
        LEFT JOIN result_cache AS c
               ON c.cache_key = t.cache_key AND li.item_id IS NULL""",
    after=""", led AS (
        INSERT INTO dedup_leads (job_id, request_key, item_id, lease_owner)
        SELECT DISTINCT ON (t.lead_key) {job_id}, t.lead_key, r.item_id, {registered_lead}
        FROM registered AS r JOIN t ON t.item_id = r.item_id
        WHERE r.status = {pending} AND t.lead_key IS NOT NULL
          AND EXISTS (SELECT FROM shards AS s WHERE s.job_id = {job_id} AND s.shard > {shard})
        ORDER BY t.lead_key, t.ordinal
        ON CONFLICT (job_id, request_key) DO NOTHING
    )""",
)


def register_answers(
    keys: Sequence[tuple[str | None, str | None]], *, anonymous: bool
) -> Answering:
    """:data:`REGISTER_ANSWERS` for a registration whose items have ``keys`` (each
    one's lead key and cache key, in the items' order; None: not answered so)."""
    return Answering(
        REGISTER_ANSWERS,
        keys=([c for _, c in keys], [k for k, _ in keys]),
        params=(ResultSource.DEDUPLICATED, ResultSource.CACHED, anonymous, REGISTERED_LEAD),
    )


@dataclass(slots=True)
class Lead:
    """Who generates a distinct request of a job, and how far it is: ``result`` is
    set once the leader item succeeded."""

    request_key: str
    item_id: str
    result: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None


# When lead ``l`` of leader item ``i`` was last renewed: taken (or renewed by a worker
# of an earlier release) at ``l.renewed_at``, renewed since with its shard's row while
# that names the lead's lease (:func:`renew_leads`). greatest() skips a NULL.
_RENEWED = """greatest(l.renewed_at, (
    SELECT s.leads_renewed_at FROM shards AS s
    WHERE s.job_id = i.job_id AND s.shard = i.shard AND s.leads_lease = l.lease_owner))"""


# Lead ``l``'s item, looked up by its key for each lead: on a ledger autoanalyze has
# not seen yet (a new deployment's first jobs), the planner took the job's items for
# one row and put them outside a loop over the leads, reading every lead of the job
# for each item (15-19 ms a waiting shard's poll of 416 requests, against 1 ms). A
# LATERAL subquery with a LIMIT is a loop over the leads whatever the statistics, and
# its order by the primary key makes the lookup that index's.
_LEADER = """(
    SELECT i.job_id, i.shard, i.status, i.lease_owner, i.result,
           i.prompt_tokens, i.completion_tokens
    FROM items AS i WHERE i.job_id = l.job_id AND i.item_id = l.item_id
    ORDER BY i.job_id, i.item_id LIMIT 1
) AS i"""


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
    dead; a lead that registering took names no attempt's lease, so the first
    attempt that asks takes it) or the lead was not renewed for ``stale_after_s``.
    Fenced in the WHERE clause, so of two shards asking at once exactly one leads.
    """
    if not leads:
        return set()
    rows = await pool.fetch(
        f"""
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
                              AND {_RENEWED} >= now() - make_interval(secs => $5))))
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


async def renew_leads(pool: Database, *, job_id: str, shard: int, lease_owner: str) -> None:
    """Tell waiting shards that ``lease_owner``'s leads (an attempt of ``shard``) are
    alive: one write, the shard's row, however many it leads. A shard the ledger has
    no row for (items registered without a plan) renews each lead instead."""
    status = await pool.execute(
        "UPDATE shards SET leads_lease = $3, leads_renewed_at = now() "
        "WHERE job_id = $1 AND shard = $2",
        job_id,
        shard,
        lease_owner,
    )
    if status == "UPDATE 0":
        await pool.execute(
            "UPDATE dedup_leads SET renewed_at = now() WHERE job_id = $1 AND lease_owner = $2",
            job_id,
            lease_owner,
        )


async def leads(pool: Database, *, job_id: str, request_keys: Sequence[str]) -> dict[str, Lead]:
    """The current leads of ``request_keys``, with the leader's result where it has one."""
    if not request_keys:
        return {}
    rows = await pool.fetch(
        f"""
        SELECT l.request_key, l.item_id,
               CASE WHEN i.status = $3 THEN i.result END AS result,
               i.prompt_tokens, i.completion_tokens
        FROM dedup_leads AS l
        CROSS JOIN LATERAL {_LEADER}
        WHERE l.job_id = {THIS_JOB} AND l.request_key = ANY($2::text[])
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


@dataclass(frozen=True, slots=True)
class LeadProgress:
    """Where the leads of a shard's requests stand: of its distinct request keys,
    ``answered`` have a succeeded leader and ``elsewhere`` a leader that runs in
    another shard under a lead renewed lately; the rest have none alive (nobody
    leads them, or the leader's attempt is gone), so the shard must run them."""

    keys: int
    answered: int
    elsewhere: int

    @property
    def all_answered(self) -> bool:
        return self.answered == self.keys

    @property
    def worth_waiting(self) -> bool:
        """Every key is answered or led alive by another shard, and not all answered."""
        return not self.all_answered and self.answered + self.elsewhere == self.keys


async def lead_progress(
    pool: Database,
    *,
    job_id: str,
    shard: int,
    request_keys: Sequence[str],
    stale_after_s: float,
) -> LeadProgress:
    """How far the job's leads of ``request_keys`` (distinct) are, seen from ``shard``.

    A lead counts as alive as :func:`take_leads` has it (its item runs under the
    lead's lease, renewed within ``stale_after_s``), and only in another shard: a
    shard never waits for itself. So does a lead that registering took, for
    ``stale_after_s`` from then, while its item waits for its shard's generate step
    (pending, or claimed and about to be led by that step)."""
    row = await pool.fetchrow(
        f"""
        SELECT count(*) FILTER (WHERE i.status = $4) AS answered,
               count(*) FILTER (
                   WHERE i.shard <> $2 AND (
                       (i.status = $5 AND i.lease_owner = l.lease_owner
                        AND {_RENEWED} >= now() - make_interval(secs => $6))
                       OR (l.lease_owner = $8 AND i.status IN ($5, $7)
                           AND l.renewed_at >= now() - make_interval(secs => $6))
                   )) AS elsewhere
        FROM dedup_leads AS l
        CROSS JOIN LATERAL {_LEADER}
        WHERE l.job_id = {THIS_JOB} AND l.request_key = ANY($3::text[])
        """,
        job_id,
        shard,
        list(request_keys),
        ItemStatus.SUCCEEDED,
        ItemStatus.RUNNING,
        stale_after_s,
        ItemStatus.PENDING,
        REGISTERED_LEAD,
    )
    assert row is not None  # an aggregate always returns its row
    return LeadProgress(
        keys=len(request_keys), answered=row["answered"], elsewhere=row["elsewhere"]
    )


# The followers reached through their requests: see THIS_JOB in llmbatch.ledger.db.
# The shard is compared as no index can (IS NOT DISTINCT FROM): on a fresh ledger the
# planner took (job, shard) in items_by_shard for one row and looked each follower up
# there, reading its whole shard 9,000 times; by its id, each is one row.
_FOLLOWERS = batch_rows(
    "$3::text[], $6::text[]",
    "item_id, request_key",
    carried="$2::int AS shard, $4::text AS succeeded, $7::text AS pending",
)
_ANSWER = f"""
    UPDATE items AS i
    SET status = $4, result = li.result, prompt_tokens = li.prompt_tokens,
        completion_tokens = li.completion_tokens, latency_ms = 0.0,
        result_source = $5, shared_with = li.item_id, finished_at = now(),
        updated_at = now()
    FROM {_FOLLOWERS} AS t
    JOIN dedup_leads AS l ON l.job_id = {THIS_JOB} AND l.request_key = t.request_key
    JOIN items AS li
      ON li.job_id = {THIS_JOB} AND li.item_id = l.item_id AND li.status = t.succeeded
    WHERE i.job_id = {THIS_JOB} AND i.item_id = t.item_id
      AND i.shard IS NOT DISTINCT FROM t.shard AND i.status = t.pending
    RETURNING i.item_id, i.prompt_tokens, i.completion_tokens
"""


async def answer_from_leads(
    pool: Database, *, job_id: str, shard: int, items: Sequence[tuple[str, str]]
) -> tuple[set[str], Answered]:
    """Answer the pending ones of ``items`` (item id, request key) of ``shard`` whose
    lead has succeeded, as registering would have (``deduplicated``, shared with the
    leader); return their ids and what was answered. Fenced on ``pending``: an item a
    generate attempt claimed, or a concurrent answer finished, is left alone."""
    rows = await pool.fetch(
        _ANSWER,
        job_id,
        shard,
        [item_id for item_id, _ in items],
        ItemStatus.SUCCEEDED,
        ResultSource.DEDUPLICATED,
        [key for _, key in items],
        ItemStatus.PENDING,
    )
    return {r["item_id"] for r in rows}, Answered(
        source=ResultSource.DEDUPLICATED,
        items=len(rows),
        prompt_tokens=sum(r["prompt_tokens"] or 0 for r in rows),
        completion_tokens=sum(r["completion_tokens"] or 0 for r in rows),
    )
