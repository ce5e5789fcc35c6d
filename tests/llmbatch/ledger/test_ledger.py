"""The item ledger, each test on a fresh migrated database of the session's Postgres."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from llmbatch import ledger
from llmbatch.contract.states import ErrorClass

JOB = "job-1"


def new(n: int, *, start: int = 0) -> list[ledger.items.NewItem]:
    return [
        ledger.items.NewItem(f"i{k}", k, f"h{k}", f"f.jsonl:line {k + 1}") for k in range(start, n)
    ]


def result(item_id: str, text: str = "ok") -> ledger.items.ItemResult:
    return ledger.items.ItemResult(item_id, {"text": text, "finish_reason": "stop"}, 3, 2, 1.5)


def dead(
    item_id: str, error_class: ErrorClass = ErrorClass.INVALID_ROW, message: str = "x"
) -> ledger.items.DeadItem:
    return ledger.items.DeadItem(item_id, 0, error_class, message, f"f.jsonl:{item_id}")


async def statuses(pool: asyncpg.Pool, *, shard: int = 0) -> dict[str, str]:
    return {
        r.item_id: r.status for r in await ledger.items.shard_results(pool, job_id=JOB, shard=shard)
    }


async def test_a_job_is_recorded_once(ledger_pool: asyncpg.Pool) -> None:
    spec = {"model": "tiny", "sampling": {"temperature": 0.0}}
    assert await ledger.jobs.upsert_job(
        ledger_pool, job_id=JOB, spec=spec, model="tiny", output_uri="s3://b/out"
    )
    assert not await ledger.jobs.upsert_job(
        ledger_pool, job_id=JOB, spec={"other": 1}, model="x", output_uri="s3://b/x"
    )
    row = await ledger_pool.fetchrow("SELECT spec, model, status FROM jobs WHERE job_id = $1", JOB)
    assert row is not None
    assert (row["spec"], row["model"], row["status"]) == (spec, "tiny", "running")


async def test_register_claim_record_round_trip(ledger_pool: asyncpg.Pool) -> None:
    assert (
        await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    ).done == set()
    claimed = await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=["i0", "i1", "i2"], lease_owner="a"
    )
    assert claimed == {"i0", "i1", "i2"}
    written = await ledger.items.record_results(
        ledger_pool, job_id=JOB, lease_owner="a", results=[result("i0")]
    )
    assert written == 1
    too_long = dead("i1", ErrorClass.PROMPT_TOO_LONG, "too long")
    assert (
        await ledger.items.record_dead(ledger_pool, job_id=JOB, lease_owner="a", items=[too_long])
        == 1
    )

    rows = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert [(r.item_id, r.status, r.attempt) for r in rows] == [
        ("i0", "succeeded", 1),
        ("i1", "dead", 1),
        ("i2", "running", 1),
    ]
    assert rows[0].result == {"text": "ok", "finish_reason": "stop"}
    assert (rows[0].prompt_tokens, rows[0].completion_tokens, rows[0].latency_ms) == (3, 2, 1.5)
    assert rows[0].finished_at is not None
    assert (rows[1].error_class, rows[1].error_message) == ("PromptTooLong", "too long")
    assert rows[2].result is None

    counts = await ledger.jobs.job_counts(ledger_pool, job_id=JOB)
    assert counts == ledger.jobs.JobCounts(
        total=3, pending=0, running=1, succeeded=1, dead=1, prompt_tokens=3, completion_tokens=2
    )
    letters = await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB)
    assert [(d.item_id, d.shard, d.error_class, d.attempts, d.source) for d in letters] == [
        ("i1", 0, "PromptTooLong", 1, "f.jsonl:i1")
    ]


async def test_shard_rows_keep_input_order(ledger_pool: asyncpg.Pool) -> None:
    # Ordinals, not ids, give the order: "i10" sorts before "i2" as text.
    items = [ledger.items.NewItem(f"i{k}", k, None, f"line {k}") for k in (10, 2, 1)]
    items += [ledger.items.NewItem("other-shard", 0, None, "x")]
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=3, items=items[:3])
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=4, items=items[3:])
    rows = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=3)
    assert [r.item_id for r in rows] == ["i1", "i2", "i10"]
    assert [r.status for r in rows] == ["pending"] * 3


async def test_a_finished_item_is_never_claimed_or_rewritten(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="a")
    await ledger.items.record_results(
        ledger_pool, job_id=JOB, lease_owner="a", results=[result("i0", "first")]
    )
    await ledger.items.record_dead(ledger_pool, job_id=JOB, lease_owner="a", items=[dead("i1")])

    # A re-run of the shard: registering again reports both as done; claiming skips them.
    assert (
        await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    ).done == {
        "i0",
        "i1",
    }
    claimed = await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=["i0", "i1", "i2"], lease_owner="b"
    )
    assert claimed == {"i2"}
    # Not even an owner holding the lease on paper can change a finished item.
    for owner in ("a", "b"):
        assert (
            await ledger.items.record_results(
                ledger_pool, job_id=JOB, lease_owner=owner, results=[result("i0", "x")]
            )
            == 0
        )
        assert (
            await ledger.items.record_results(
                ledger_pool, job_id=JOB, lease_owner=owner, results=[result("i1", "x")]
            )
            == 0
        )
        assert (
            await ledger.items.record_dead(
                ledger_pool, job_id=JOB, lease_owner=owner, items=[dead("i0")]
            )
            == 0
        )
    assert (
        await ledger.items.record_dead(
            ledger_pool, job_id=JOB, lease_owner=None, items=[dead("i0")]
        )
        == 0
    )

    rows = {
        r.item_id: r for r in await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    }
    assert (rows["i0"].status, rows["i0"].result, rows["i0"].attempt) == (
        "succeeded",
        {"text": "first", "finish_reason": "stop"},
        1,
    )
    assert (rows["i1"].status, rows["i1"].result, rows["i1"].attempt) == ("dead", None, 1)
    assert [d.item_id for d in await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB)] == [
        "i1"
    ]


async def test_a_stale_attempt_cannot_overwrite_a_newer_one(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(2))
    await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="old"
    )
    # The old attempt stalls past its heartbeat timeout; a new attempt takes the items.
    await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="new"
    )

    late = await ledger.items.record_results(
        ledger_pool, job_id=JOB, lease_owner="old", results=[result("i0", "stale")]
    )
    assert late == 0
    assert (
        await ledger.items.record_dead(
            ledger_pool, job_id=JOB, lease_owner="old", items=[dead("i1")]
        )
        == 0
    )
    assert await statuses(ledger_pool) == {"i0": "running", "i1": "running"}
    assert await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB) == []

    fresh = [result("i0", "new"), result("i1", "new")]
    assert (
        await ledger.items.record_results(ledger_pool, job_id=JOB, lease_owner="new", results=fresh)
        == 2
    )
    # The zombie wakes up once more after the new attempt finished: still nothing.
    assert (
        await ledger.items.record_results(
            ledger_pool, job_id=JOB, lease_owner="old", results=[result("i0", "stale")]
        )
        == 0
    )
    rows = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert [(r.status, r.result, r.attempt) for r in rows] == [
        ("succeeded", {"text": "new", "finish_reason": "stop"}, 2)
    ] * 2


async def test_a_batch_writes_only_the_rows_its_owner_holds(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(4))
    await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="a")
    await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=["i2"], lease_owner="b")
    batch = [result(f"i{k}") for k in range(4)]
    assert (
        await ledger.items.record_results(ledger_pool, job_id=JOB, lease_owner="a", results=batch)
        == 2
    )
    assert await statuses(ledger_pool) == {
        "i0": "succeeded",
        "i1": "succeeded",
        "i2": "running",
        "i3": "pending",  # never claimed: no result lands without a lease
    }


async def test_an_unclaimed_item_can_be_dead_lettered(ledger_pool: asyncpg.Pool) -> None:
    # A row that fails to render never reaches generation, so nobody claims it.
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(2))
    bad = dead("i0", ErrorClass.TEMPLATE_ERROR, "missing field 'q'")
    assert (
        await ledger.items.record_dead(ledger_pool, job_id=JOB, lease_owner=None, items=[bad]) == 1
    )
    (letter,) = await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB)
    assert (letter.item_id, letter.error_class, letter.message, letter.attempts) == (
        "i0",
        "TemplateError",
        "missing field 'q'",
        0,
    )
    assert await statuses(ledger_pool) == {"i0": "dead", "i1": "pending"}


async def test_requeue_brings_a_dead_item_back(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="a")
    await ledger.items.record_dead(ledger_pool, job_id=JOB, lease_owner="a", items=[dead("i0")])
    await ledger.items.record_results(
        ledger_pool, job_id=JOB, lease_owner="a", results=[result("i1")]
    )

    # Only the dead one moves; a succeeded or pending item is not "re-driven".
    requeued = await ledger.dead_letters.requeue_dead(
        ledger_pool, job_id=JOB, item_ids=["i0", "i1", "i2"]
    )
    assert requeued == ledger.dead_letters.Requeued(item_ids=["i0"], shards=[0])
    assert await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB) == []
    (row, *_) = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert (row.status, row.error_class, row.error_message, row.attempt) == (
        "pending",
        None,
        None,
        1,
    )
    assert (
        await ledger.dead_letters.requeue_dead(ledger_pool, job_id=JOB, item_ids=["i0"])
    ).item_ids == []

    assert (
        await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    ).done == {"i1"}
    claimed = await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=["i0"], lease_owner="c"
    )
    assert claimed == {"i0"}
    assert (
        await ledger.items.record_results(
            ledger_pool, job_id=JOB, lease_owner="c", results=[result("i0")]
        )
        == 1
    )
    (row, *_) = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert (row.status, row.attempt) == ("succeeded", 2)


async def test_jobs_do_not_see_each_other(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(2))
    await ledger.items.register_items(ledger_pool, job_id="job-2", shard=0, items=new(2))
    await ledger.items.claim_items(ledger_pool, job_id="job-2", item_ids=["i0"], lease_owner="a")
    await ledger.items.record_results(
        ledger_pool, job_id="job-2", lease_owner="a", results=[result("i0")]
    )
    assert await statuses(ledger_pool) == {"i0": "pending", "i1": "pending"}
    assert (await ledger.jobs.job_counts(ledger_pool, job_id="job-2")).succeeded == 1


async def test_calls_join_a_callers_transaction(ledger_pool: asyncpg.Pool) -> None:
    async with ledger_pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await ledger.items.register_items(conn, job_id=JOB, shard=0, items=new(2))
        assert await ledger.items.claim_items(
            conn, job_id=JOB, item_ids=["i0"], lease_owner="a"
        ) == {"i0"}
        await tx.rollback()
    assert (await ledger.jobs.job_counts(ledger_pool, job_id=JOB)).total == 0


async def test_empty_batches_are_no_ops(ledger_pool: asyncpg.Pool) -> None:
    assert await ledger.items.register_items(
        ledger_pool, job_id=JOB, shard=0, items=[]
    ) == ledger.items.Registered(set(), set())
    assert (
        await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=[], lease_owner="a")
        == set()
    )
    assert (
        await ledger.items.record_results(ledger_pool, job_id=JOB, lease_owner="a", results=[]) == 0
    )
    assert await ledger.items.record_dead(ledger_pool, job_id=JOB, lease_owner=None, items=[]) == 0
    assert (
        await ledger.dead_letters.requeue_dead(ledger_pool, job_id=JOB, item_ids=[])
    ).item_ids == []
    assert await ledger.jobs.job_counts(ledger_pool, job_id=JOB) == ledger.jobs.JobCounts(
        0, 0, 0, 0, 0, 0, 0
    )


@pytest.mark.parametrize("batch", [256, 10_000])
async def test_ten_thousand_items(ledger_pool: asyncpg.Pool, batch: int) -> None:
    n = 10_000
    items = new(n)
    ids = [i.item_id for i in items]
    started = time.perf_counter()
    assert (
        await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=items)
    ).done == set()
    registered = time.perf_counter()
    claimed = await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=ids, lease_owner="a")
    assert len(claimed) == n
    claimed_at = time.perf_counter()
    for k in range(0, n, batch):
        results = [result(i) for i in ids[k : k + batch]]
        written = await ledger.items.record_results(
            ledger_pool, job_id=JOB, lease_owner="a", results=results
        )
        assert written == len(results)
    done = time.perf_counter()
    print(
        f"\n{n:,} items, results in batches of {batch:,}: register {registered - started:.2f} s, "
        f"claim {claimed_at - registered:.2f} s, record {done - claimed_at:.2f} s, "
        f"total {done - started:.2f} s"
    )
    counts = await ledger.jobs.job_counts(ledger_pool, job_id=JOB)
    assert (counts.succeeded, counts.prompt_tokens, counts.completion_tokens) == (n, 3 * n, 2 * n)
    # A re-run of the whole shard finds everything done in one call.
    assert (
        len((await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=items)).done)
        == n
    )


async def test_an_id_registered_by_another_shard_is_reported_not_taken(
    ledger_pool: asyncpg.Pool,
) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(2))
    registered = await ledger.items.register_items(
        ledger_pool,
        job_id=JOB,
        shard=1,
        items=[ledger.items.NewItem("i1", 7, "h", "g.jsonl:line 1")],
    )
    assert registered == ledger.items.Registered(done=set(), elsewhere={"i1"})
    # The first shard keeps the item: same shard, same ordinal as before.
    (_, row) = await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=0)
    assert (row.item_id, row.ordinal) == ("i1", 1)
    assert await ledger.items.shard_results(ledger_pool, job_id=JOB, shard=1) == []


async def test_a_shard_waiting_on_another_shards_insert_of_an_id_reports_it_elsewhere(
    ledger_pool: asyncpg.Pool,
) -> None:
    # A first registration is a plain insert (no conflict check per row): a shard that
    # inserts an id another shard's open transaction holds waits for it, then must
    # find the id taken, register the rest, and run nothing twice.
    async with ledger_pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await ledger.items.register_items(conn, job_id=JOB, shard=0, items=new(2))
        second = asyncio.create_task(
            ledger.items.register_items(
                ledger_pool,
                job_id=JOB,
                shard=1,
                items=[
                    ledger.items.NewItem("i1", 7, "h", "g.jsonl:line 1"),
                    ledger.items.NewItem("j1", 8, "h", "g.jsonl:line 2"),
                ],
            )
        )
        await asyncio.sleep(0.5)
        assert not second.done()  # waiting on shard 0's insert of i1
        await tx.commit()
    assert await second == ledger.items.Registered(done=set(), elsewhere={"i1"})
    assert await statuses(ledger_pool) == {"i0": "pending", "i1": "pending"}
    assert await statuses(ledger_pool, shard=1) == {"j1": "pending"}


async def test_a_shard_that_fails_unread_is_held_by_dead_placeholders(
    ledger_pool: asyncpg.Pool,
) -> None:
    await ledger.jobs.record_shards(
        ledger_pool,
        job_id=JOB,
        shards=[
            ledger.jobs.PlannedShard(0, "s3://b/in.jsonl", 0, 2, 1),
            ledger.jobs.PlannedShard(1, "s3://b/in.jsonl", 2, 3, 3),
        ],
    )
    counts = await ledger.dead_letters.dead_letter_shard(
        ledger_pool, job_id=JOB, shard=1, error_class=ErrorClass.SHARD_FAILED, error_message="503"
    )
    assert (counts.succeeded, counts.dead) == (0, 3)
    letters = await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB, shard=1)
    assert [d.item_id for d in letters] == ["row-2", "row-3", "row-4"]
    assert {d.error_class for d in letters} == {ErrorClass.SHARD_FAILED}
    assert letters[0].source == "s3://b/in.jsonl (row 1 of 3 in shard 1, never read)"

    # A re-drive makes them pending; reading the real rows then replaces them.
    requeued = await ledger.dead_letters.requeue_dead(
        ledger_pool, job_id=JOB, error_classes=[ErrorClass.SHARD_FAILED]
    )
    assert requeued == ledger.dead_letters.Requeued(
        item_ids=["row-2", "row-3", "row-4"], shards=[1]
    )
    real = [ledger.items.NewItem(f"id-{k}", 2 + k, "h", f"in.jsonl:line {3 + k}") for k in range(3)]
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=1, items=real)
    assert list(await statuses(ledger_pool, shard=1)) == ["id-0", "id-1", "id-2"]
    assert (await ledger.jobs.job_counts(ledger_pool, job_id=JOB)).total == 3


async def test_a_failed_shard_keeps_its_results_and_kills_the_rest(
    ledger_pool: asyncpg.Pool,
) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    await ledger.items.claim_items(ledger_pool, job_id=JOB, item_ids=["i0", "i1"], lease_owner="a")
    await ledger.items.record_results(
        ledger_pool, job_id=JOB, lease_owner="a", results=[result("i0")]
    )
    counts = await ledger.dead_letters.dead_letter_shard(
        ledger_pool, job_id=JOB, shard=0, error_class=ErrorClass.SHARD_FAILED, error_message="gone"
    )
    assert (counts.succeeded, counts.dead, counts.tokens.prompt) == (1, 2, 3)
    assert await statuses(ledger_pool) == {"i0": "succeeded", "i1": "dead", "i2": "dead"}
    # The source of a row that was read stays its own (file and line).
    assert {d.source for d in await ledger.dead_letters.dead_items(ledger_pool, job_id=JOB)} == {
        "f.jsonl:line 2",
        "f.jsonl:line 3",
    }


async def test_requeue_by_error_class_or_everything(ledger_pool: asyncpg.Pool) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(3))
    await ledger.items.record_dead(
        ledger_pool,
        job_id=JOB,
        lease_owner=None,
        items=[
            dead("i0", ErrorClass.INVALID_ROW),
            dead("i1", ErrorClass.TEMPLATE_ERROR),
            dead("i2", ErrorClass.TEMPLATE_ERROR),
        ],
    )
    assert (
        await ledger.dead_letters.requeue_dead(
            ledger_pool, job_id=JOB, error_classes=[ErrorClass.TEMPLATE_ERROR]
        )
    ).item_ids == [
        "i1",
        "i2",
    ]
    assert (await ledger.dead_letters.requeue_dead(ledger_pool, job_id=JOB)).item_ids == ["i0"]


async def test_a_stale_attempt_cannot_claim_what_a_newer_one_holds(
    ledger_pool: asyncpg.Pool,
) -> None:
    await ledger.items.register_items(ledger_pool, job_id=JOB, shard=0, items=new(2))
    ids = ["i0", "i1"]
    newer = await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=ids, lease_owner="g#2", activity="g", attempt=2
    )
    assert newer == {"i0", "i1"}
    # Attempt 1 of the same activity wakes up late: it takes nothing.
    stale = await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=ids, lease_owner="g#1", activity="g", attempt=1
    )
    assert stale == set()
    assert (
        await ledger.items.record_results(
            ledger_pool, job_id=JOB, lease_owner="g#2", results=[result("i0")]
        )
        == 1
    )
    # A later attempt still takes over what is unfinished.
    assert await ledger.items.claim_items(
        ledger_pool, job_id=JOB, item_ids=ids, lease_owner="g#3", activity="g", attempt=3
    ) == {"i1"}
