"""The ledger's statements stay linear in a job the planner's statistics have not seen.

Every job's id is new to Postgres's statistics: until autoanalyze runs, the planner
takes the job for empty (one row), and the statuses a running job has (``pending``,
``running``) for rare. A plan built on that once nested a shard's 9,000 items around
a scan of its 9,000 requests: 81 million comparisons, 26 s of Postgres for a
statement that takes 0.1 s (``answer_from_leads`` in a deduplicated job). Here the
ledger's functions run a job's life on a real Postgres whose statistics know only
an earlier, finished job, with ``auto_explain`` reporting every statement's plan as
it ran: no plan node run once for each row of another may handle more rows, over
all its runs, than a small multiple of the items the statement was about.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import asyncpg
import pytest
import pytest_asyncio

from llmbatch import ledger
from llmbatch.contract.states import ErrorClass
from llmbatch.dedup import leads
from llmbatch.ledger.db import _init_connection
from llmbatch.ledger.jobs import PlannedShard

# Shard 0 leads KEYS requests among its SHARD0 rows; shard 1 repeats them in FOLLOWERS.
KEYS, SHARD0, FOLLOWERS = 200, 1_000, 9_000
# A plan node run once per row of another may handle this many rows per item of its
# statement, over all its runs: looking an item, its lead and its lead's item up by
# key reads a few; a nested scan reads every item of the shard, or the job, for each.
ROWS_PER_ITEM = 8
T = TypeVar("T")


class Plans:
    """The plans ``auto_explain`` sends while statements run (as LOG notices)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, conn: object, message: asyncpg.PostgresLogMessage) -> None:
        text = message.message
        if "{" in text:
            self.seen.append(json.loads(text[text.index("{") :]))

    def handled(self) -> list[tuple[float, str]]:
        """For each statement, the most rows any of its plan's nodes that ran more
        than once handled over all its runs (rows out and rows its filters threw
        away), and where: the node's type and the statement's first line. A node run
        once reads what it reads once, a choice Postgres makes knowing the table's
        size; a node run again for each row of another is what grows as the square."""
        out = []

        def most(node: dict[str, Any]) -> tuple[float, str]:
            loops = node.get("Actual Loops", 1)
            rows = loops * (
                node.get("Actual Rows", 0)
                + node.get("Rows Removed by Join Filter", 0)
                + node.get("Rows Removed by Filter", 0)
            )
            here = (rows if loops > 1 else 0.0, node["Node Type"])
            return max([here, *(most(c) for c in node.get("Plans", []))])

        for plan in self.seen:
            rows, node = most(plan["Plan"])
            query = " ".join(plan.get("Query Text", "").split())[:120]
            out.append((rows, f"{node} in {query}"))
        return out


@pytest_asyncio.fixture
async def explained(ledger_dsn: str) -> AsyncIterator[tuple[asyncpg.Connection, Plans]]:
    """A ledger connection that reports each statement's plan, as run."""
    conn = await asyncpg.connect(ledger_dsn)
    await _init_connection(conn)
    plans = Plans()
    try:
        await conn.execute("LOAD 'auto_explain'")
        for setting in (
            "auto_explain.log_min_duration = 0",
            "auto_explain.log_analyze = on",
            "auto_explain.log_timing = off",
            "auto_explain.log_format = json",
            "client_min_messages = log",
        ):
            await conn.execute(f"SET {setting}")
        conn.add_log_listener(plans)
        yield conn, plans
    finally:
        await conn.close()


async def _finished_job(conn: asyncpg.Connection, n: int) -> None:
    """An earlier job, every item succeeded, which the statistics are taken from."""
    await conn.execute(
        "INSERT INTO items (job_id, item_id, shard, ordinal, status, result, finished_at) "
        "SELECT 'earlier', 'r' || g, g / 1000, g, 'succeeded', '{\"text\": \"t\"}', now() "
        "FROM generate_series(0, $1 - 1) AS g",
        n,
    )
    await conn.execute("ANALYZE items")
    await conn.execute("ANALYZE dedup_leads")


@pytest.mark.parametrize("earlier", [20_000, 0], ids=["another-jobs-statistics", "a-fresh-ledger"])
async def test_a_new_jobs_statements_stay_linear(
    explained: tuple[asyncpg.Connection, Plans], earlier: int
) -> None:
    """On the statistics of another, finished job; and on a fresh ledger, whose tables
    autoanalyze has not seen yet (the first job after ``llm-batch migrate``)."""
    conn, plans = explained
    if earlier:
        await _finished_job(conn, earlier)
    job = f"new-{uuid.uuid4().hex[:8]}"
    keys = [f"{k:064x}" for k in range(KEYS)]

    async def linear(n: int, step: Awaitable[T]) -> T:
        """Run one ledger call about ``n`` items; no node of its plans may handle
        more than ROWS_PER_ITEM rows an item."""
        plans.seen.clear()
        result = await step
        assert plans.seen, "auto_explain reported no plan"
        nested = [(rows, where) for rows, where in plans.handled() if rows > ROWS_PER_ITEM * n]
        assert not nested, "\n".join(f"{rows:.0f} rows for {n} items: {where}"
                                      for rows, where in nested)  # fmt: skip
        return result

    def new(shard: int, n: int, *, offset: int) -> list[ledger.items.NewItem]:
        return [
            ledger.items.NewItem(
                item_id=f"s{shard}-{i}",
                ordinal=offset + i,
                prompt_hash=keys[i % KEYS],
                source="rows.jsonl",
            )
            for i in range(n)
        ]

    def register(shard: int, items: list[ledger.items.NewItem], *, by_leads: bool = True) -> Any:
        """Register ``items`` as prepare does, answered from the job's leads (by their
        request keys) when ``by_leads``, else by nothing (a sampled job's requests)."""
        return ledger.items.register_items(
            conn,
            job_id=job,
            shard=shard,
            items=items,
            answering=leads.register_answers(
                [(i.prompt_hash if by_leads else None, None) for i in items], anonymous=False
            ),
        )

    # Shard 0 registers, and shard 1 while shard 0's generate step runs: shard 0
    # claims its items, takes the leads and records them; then the leads answer
    # shard 1. A third shard's rows (none of them rendered) are claimed, given back, looked
    # up and die.
    first, second = new(0, SHARD0, offset=0), new(1, FOLLOWERS, offset=SHARD0)
    # Planned, so that registering shard 0 leads its requests (shards come after it),
    # and shard 0's generate step takes those leads over.
    await ledger.jobs.record_shards(
        conn, job_id=job, shards=[PlannedShard(n, "rows.jsonl", 0, 0, None) for n in range(3)]
    )
    await linear(SHARD0, register(0, first))
    assert await conn.fetchval("SELECT count(*) FROM dedup_leads WHERE job_id = $1", job) == KEYS
    # Shard 1, rendered, polls the leads registering took (a waiting shard's poll).
    waiting = await linear(
        KEYS,
        leads.lead_progress(conn, job_id=job, shard=1, request_keys=keys, stale_after_s=60),
    )
    assert waiting.worth_waiting
    # Shard 0's generate attempt looks its requests' leads up before it takes them.
    current = await linear(KEYS, leads.leads(conn, job_id=job, request_keys=keys))
    assert len(current) == KEYS
    # A shard that found no lead asks whether the shards before it registered.
    assert await linear(1, ledger.jobs.shards_unregistered(conn, job_id=job, before=2)) == 1
    await linear(FOLLOWERS, register(1, second))
    owner = "gpu#1"
    claimed = await linear(
        SHARD0,
        ledger.items.claim_items(
            conn, job_id=job, item_ids=[i.item_id for i in first], lease_owner=owner
        ),
    )
    assert len(claimed) == SHARD0
    await linear(
        KEYS,
        leads.take_leads(
            conn,
            job_id=job,
            leads=[(keys[i], f"s0-{i}") for i in range(KEYS)],
            lease_owner=owner,
            stale_after_s=60,
        ),
    )
    progress = await linear(
        KEYS,
        leads.lead_progress(conn, job_id=job, shard=1, request_keys=keys, stale_after_s=60),
    )
    assert progress.worth_waiting
    results = [ledger.items.ItemResult(i.item_id, {"text": "t"}, 3, 2, 1.0) for i in first]
    recorded = await linear(
        SHARD0,
        ledger.items.record_results(conn, job_id=job, lease_owner=owner, results=results),
    )
    assert recorded == SHARD0
    answered, _ = await linear(
        FOLLOWERS,
        leads.answer_from_leads(
            conn, job_id=job, shard=1, items=[(i.item_id, i.prompt_hash or "") for i in second]
        ),
    )
    assert len(answered) == FOLLOWERS
    third = new(2, SHARD0, offset=SHARD0 + FOLLOWERS)
    await linear(SHARD0, register(2, third, by_leads=False))
    ids = [i.item_id for i in third]
    await linear(SHARD0, ledger.items.claim_items(conn, job_id=job, item_ids=ids, lease_owner="b"))
    released = await linear(
        SHARD0, ledger.items.release_items(conn, job_id=job, lease_owner="b", item_ids=ids)
    )
    assert released == SHARD0
    looked_up = await linear(SHARD0, ledger.items.items_by_id(conn, job_id=job, item_ids=ids))
    assert len(looked_up) == SHARD0
    dead = [
        ledger.items.DeadItem(i.item_id, 2, ErrorClass.PROMPT_TOO_LONG, "too long", None)
        for i in third
    ]
    marked = await linear(
        SHARD0, ledger.items.record_dead(conn, job_id=job, lease_owner=None, items=dead)
    )
    assert marked == SHARD0
    rows = await linear(FOLLOWERS, ledger.items.shard_results(conn, job_id=job, shard=1))
    assert len(rows) == FOLLOWERS
