"""The item ledger on the session's Postgres; every test uses its own job id."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest_asyncio

from llmbatch import ledger


@pytest_asyncio.fixture(scope="module")
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await ledger.create_pool(pg_dsn)
    yield pool
    await pool.close()


def job() -> str:
    return f"ledger-{uuid.uuid4().hex[:8]}"


def new(n: int) -> list[ledger.NewItem]:
    return [ledger.NewItem(f"i{k}", k, f"h{k}", f"f.jsonl:line {k + 1}") for k in range(n)]


def result(item_id: str, text: str = "ok") -> ledger.ItemResult:
    return ledger.ItemResult(item_id, {"text": text}, 3, 2, 1.5)


async def test_register_claim_record_round_trip(pool: asyncpg.Pool) -> None:
    j = job()
    assert await ledger.register_items(pool, job_id=j, shard=0, items=new(3)) == set()
    claimed = await ledger.claim_items(pool, job_id=j, item_ids=["i0", "i1", "i2"], lease_owner="a")
    assert claimed == {"i0", "i1", "i2"}
    assert await ledger.record_results(pool, job_id=j, lease_owner="a", results=[result("i0")]) == 1
    dead = ledger.DeadItem("i1", 0, "PromptTooLong", "too long", "f.jsonl:line 2")
    assert await ledger.record_dead(pool, job_id=j, lease_owner="a", items=[dead]) == 1

    rows = await ledger.shard_results(pool, job_id=j, shard=0)
    assert [(r.item_id, r.status) for r in rows] == [
        ("i0", "succeeded"),
        ("i1", "dead"),
        ("i2", "running"),
    ]
    assert rows[0].result == {"text": "ok"} and rows[0].prompt_tokens == 3
    counts = await ledger.job_counts(pool, job_id=j)
    assert (counts.total, counts.succeeded, counts.dead, counts.running) == (4 - 1, 1, 1, 1)
    letters = await ledger.dead_items(pool, job_id=j)
    assert [(d.item_id, d.error_class, d.attempts) for d in letters] == [("i1", "PromptTooLong", 1)]


async def test_a_finished_item_is_never_claimed_or_rewritten(pool: asyncpg.Pool) -> None:
    j = job()
    await ledger.register_items(pool, job_id=j, shard=0, items=new(2))
    await ledger.claim_items(pool, job_id=j, item_ids=["i0", "i1"], lease_owner="a")
    await ledger.record_results(pool, job_id=j, lease_owner="a", results=[result("i0", "first")])

    # A re-run of the shard: registering again reports i0 as done; claiming skips it.
    assert await ledger.register_items(pool, job_id=j, shard=0, items=new(2)) == {"i0"}
    assert await ledger.claim_items(pool, job_id=j, item_ids=["i0", "i1"], lease_owner="b") == {
        "i1"
    }
    assert (
        await ledger.record_results(pool, job_id=j, lease_owner="b", results=[result("i0", "x")])
        == 0
    )
    dead = ledger.DeadItem("i0", 0, "X", "x", None)
    assert await ledger.record_dead(pool, job_id=j, lease_owner=None, items=[dead]) == 0
    rows = await ledger.shard_results(pool, job_id=j, shard=0)
    assert rows[0].status == "succeeded" and rows[0].result == {"text": "first"}


async def test_a_stale_attempt_cannot_overwrite_a_newer_one(pool: asyncpg.Pool) -> None:
    j = job()
    await ledger.register_items(pool, job_id=j, shard=0, items=new(1))
    await ledger.claim_items(pool, job_id=j, item_ids=["i0"], lease_owner="old")
    # The old attempt stalls past its heartbeat timeout; a new attempt takes the item.
    await ledger.claim_items(pool, job_id=j, item_ids=["i0"], lease_owner="new")

    late = await ledger.record_results(pool, job_id=j, lease_owner="old", results=[result("i0")])
    assert late == 0
    dead = ledger.DeadItem("i0", 0, "X", "late", None)
    assert await ledger.record_dead(pool, job_id=j, lease_owner="old", items=[dead]) == 0
    fresh = [result("i0", "new")]
    assert await ledger.record_results(pool, job_id=j, lease_owner="new", results=fresh) == 1
    (row,) = await ledger.shard_results(pool, job_id=j, shard=0)
    assert (row.status, row.result, row.attempt) == ("succeeded", {"text": "new"}, 2)


async def test_requeue_brings_a_dead_item_back(pool: asyncpg.Pool) -> None:
    j = job()
    await ledger.register_items(pool, job_id=j, shard=0, items=new(1))
    dead = ledger.DeadItem("i0", 0, "TemplateError", "missing field", "f:line 1")
    assert await ledger.record_dead(pool, job_id=j, lease_owner=None, items=[dead]) == 1
    assert await ledger.requeue_dead(pool, job_id=j, item_ids=["i0"]) == 1
    assert await ledger.dead_items(pool, job_id=j) == []
    assert await ledger.claim_items(pool, job_id=j, item_ids=["i0"], lease_owner="c") == {"i0"}


async def test_batches_of_ten_thousand(pool: asyncpg.Pool) -> None:
    j = job()
    items = new(10_000)
    ids = [i.item_id for i in items]
    started = time.perf_counter()
    await ledger.register_items(pool, job_id=j, shard=0, items=items)
    await ledger.claim_items(pool, job_id=j, item_ids=ids, lease_owner="a")
    for k in range(0, 10_000, 256):
        batch = [result(i) for i in ids[k : k + 256]]
        assert await ledger.record_results(pool, job_id=j, lease_owner="a", results=batch) == len(
            batch
        )
    elapsed = time.perf_counter() - started
    print(f"10,000 items registered, claimed and recorded in {elapsed:.2f} s")
    counts = await ledger.job_counts(pool, job_id=j)
    assert counts.succeeded == 10_000 and counts.prompt_tokens == 30_000
