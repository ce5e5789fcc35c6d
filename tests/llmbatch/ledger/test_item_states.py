"""The item state machine, driven at random through the ledger's own functions on the
real Postgres: claims (by attempts old and new, so a lease that lapsed is taken over),
results, dead letters, releases, answers from the result cache at render (a render
attempt run again), a shard failing for good and dead-letter re-drives, in
any order and on any items. After every step each item's change of status must be one
of :data:`ITEM_TRANSITIONS`, no item succeeds twice, a succeeded item never changes,
and a dead one changes only through the re-drive."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmbatch import ledger
from llmbatch.contract.states import ITEM_TRANSITIONS, TERMINAL_STATUSES, ErrorClass, ItemStatus
from llmbatch.dedup import leads, result_cache

ITEMS = [f"i{k}" for k in range(4)]
# Attempts of one activity (the shard's generate): a higher number is a newer attempt,
# which takes over items an older one holds (its lease lapsed).
LEASES = [f"shard-0#{n}" for n in (1, 2, 3)]
ACTIVITY = "shard-0"

subsets = st.lists(st.sampled_from(ITEMS), min_size=1, max_size=len(ITEMS), unique=True)
leases = st.sampled_from(LEASES)
steps = st.one_of(
    st.tuples(st.just("claim"), leases, subsets),
    st.tuples(st.just("result"), leases, subsets),
    st.tuples(st.just("dead"), st.one_of(st.none(), leases), subsets),
    st.tuples(st.just("release"), leases, subsets),
    st.tuples(st.just("shard_dead"), st.none(), st.just(ITEMS)),
    st.tuples(st.just("redrive"), st.none(), subsets),
    st.tuples(st.just("answer"), st.none(), subsets),
)
Step = tuple[str, str | None, list[str]]
_jobs = itertools.count()


@dataclass(frozen=True, slots=True)
class Row:
    status: ItemStatus
    lease_owner: str | None
    result: Any
    error_class: str | None


async def _rows(pool: asyncpg.Pool, job_id: str) -> dict[str, Row]:
    rows = await pool.fetch(
        "SELECT item_id, status, lease_owner, result, error_class FROM items WHERE job_id = $1",
        job_id,
    )
    return {
        r["item_id"]: Row(ItemStatus(r["status"]), r["lease_owner"], r["result"], r["error_class"])
        for r in rows
    }


async def _apply(pool: asyncpg.Pool, job_id: str, step: Step) -> None:
    kind, lease, ids = step
    if kind == "claim":
        assert lease is not None
        attempt = int(lease.rsplit("#", 1)[1])
        await ledger.items.claim_items(
            pool,
            job_id=job_id,
            item_ids=ids,
            lease_owner=lease,
            activity=ACTIVITY,
            attempt=attempt,
        )
    elif kind == "result":
        assert lease is not None
        results = [ledger.items.ItemResult(i, {"text": f"{i} by {lease}"}, 3, 2, 1.0) for i in ids]
        await ledger.items.record_results(pool, job_id=job_id, lease_owner=lease, results=results)
    elif kind == "dead":
        dead = [
            ledger.items.DeadItem(i, 0, ErrorClass.INVALID_PROMPT, f"by {lease}", None) for i in ids
        ]
        await ledger.items.record_dead(pool, job_id=job_id, lease_owner=lease, items=dead)
    elif kind == "release":
        assert lease is not None
        await ledger.items.release_items(pool, job_id=job_id, lease_owner=lease, item_ids=ids)
    elif kind == "shard_dead":
        await ledger.dead_letters.dead_letter_shard(
            pool,
            job_id=job_id,
            shard=0,
            error_class=ErrorClass.SHARD_FAILED,
            error_message="the shard failed for good",
        )
    elif kind == "answer":
        # The render step again, the cache now holding the items' request.
        await ledger.items.register_items(
            pool,
            job_id=job_id,
            shard=0,
            items=_new(ids),
            answering=leads.register_answers(
                [(None, _cache_key(job_id))] * len(ids), anonymous=False
            ),
        )
    else:
        await ledger.dead_letters.requeue_dead(pool, job_id=job_id, item_ids=ids)


def _new(ids: list[str]) -> list[ledger.items.NewItem]:
    return [
        ledger.items.NewItem(i, ITEMS.index(i), None, f"in.jsonl:{ITEMS.index(i) + 1}") for i in ids
    ]


def _cache_key(job_id: str) -> str:
    return f"item-states:{job_id}"


def _check(step: Step, before: dict[str, Row], after: dict[str, Row], wins: dict[str, int]) -> None:
    kind, lease, ids = step
    assert after.keys() == before.keys(), "items appeared or vanished"
    for item, old in before.items():
        new = after[item]
        if new.status != old.status or new.lease_owner != old.lease_owner:
            assert (old.status, new.status) in ITEM_TRANSITIONS, (step, item, old, new)
        if old.status is ItemStatus.SUCCEEDED:
            # A terminal status never changes, and neither does the result it holds.
            assert new == old, (step, item, old, new)
        if old.status is ItemStatus.DEAD and kind != "redrive":
            assert new == old, (step, item, old, new)
        if new.status is ItemStatus.SUCCEEDED and old.status is not ItemStatus.SUCCEEDED:
            # Only the lease that held the item writes its result, or the render step
            # answers an item nobody holds from the cache.
            if kind == "answer":
                assert old.status is ItemStatus.PENDING and item in ids, (step, item, old)
                assert new.result == {"text": "from the cache"}
            else:
                assert kind == "result" and old.lease_owner == lease and item in ids
            wins[item] = wins.get(item, 0) + 1
            assert wins[item] == 1, f"{item} succeeded twice"
        if kind == "redrive" and new.status != old.status:
            assert old.status is ItemStatus.DEAD and item in ids


async def _run(dsn: str, program: list[Step]) -> None:
    job_id = f"job-{next(_jobs)}-{uuid.uuid4().hex[:8]}"
    pool = await ledger.db.create_pool(dsn, min_size=1, max_size=2)
    try:
        await result_cache.store(
            pool,
            model="m",
            weights="w",
            job_id="an-earlier-job",
            entries=[
                result_cache.NewEntry(_cache_key(job_id), {"text": "from the cache"}, 3, 2, "e0")
            ],
        )
        await ledger.items.register_items(pool, job_id=job_id, shard=0, items=_new(ITEMS))
        before = await _rows(pool, job_id)
        assert {r.status for r in before.values()} == {ItemStatus.PENDING}
        wins: dict[str, int] = {}
        for step in program:
            await _apply(pool, job_id, step)
            after = await _rows(pool, job_id)
            _check(step, before, after, wins)
            before = after
        assert set(TERMINAL_STATUSES) <= set(ItemStatus)
    finally:
        await pool.close()


@settings(
    max_examples=40,
    deadline=None,
    # One migrated database for every example: each example is a job of its own.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=st.lists(steps, min_size=1, max_size=14))
def test_random_steps_keep_the_item_state_machine(ledger_dsn: str, program: list[Step]) -> None:
    asyncio.run(_run(ledger_dsn, program))
