"""An endpoint's ``--batch-max-in-flight`` slots on the real Postgres: free slots go to
the oldest waiter first, and the rows of closed workflows are freed only for the run
that was found closed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from llmbatch.provider import slots


def _taker(
    pool: asyncpg.Pool, endpoint: str, *, max_in_flight: int = 1
) -> Callable[..., Awaitable[bool]]:
    """Takes of ``endpoint``'s slots, each token by its own job's provider-batch workflow."""

    async def take(token: str, *, run: str = "run-1") -> bool:
        return await slots.take(
            pool,
            token=token,
            endpoint=endpoint,
            job_id=f"job-{token}",
            shard=0,
            max_in_flight=max_in_flight,
            workflow_id=f"job-{token}/shard-00000/provider-batch",
            run_id=run,
        )

    return take


async def test_a_freed_slot_goes_to_the_oldest_waiter_not_to_whoever_tries_first(
    ledger_pool: asyncpg.Pool,
) -> None:
    take = _taker(ledger_pool, "fifo")
    assert await take("a")
    assert not await take("b")  # waits first
    assert not await take("c")  # waits second
    # Another endpoint's queue is its own.
    assert await _taker(ledger_pool, "other")("x")

    await slots.release(ledger_pool, token="a")
    assert not await take("c")  # tries first, but b has waited longer
    assert not await take("d")  # came last
    assert await take("b")
    assert await take("b")  # a retried take finds the slot it holds

    await slots.release(ledger_pool, token="b")
    assert not await take("d")
    assert await take("c")
    await slots.release(ledger_pool, token="c")
    assert await take("d")
    waiting = await ledger_pool.fetchval(
        "SELECT count(*) FROM provider_batch_slots WHERE endpoint = 'fifo' AND slot IS NULL"
    )
    assert waiting == 0


async def test_a_closed_holder_is_freed_only_for_the_run_that_was_checked(
    ledger_pool: asyncpg.Pool,
) -> None:
    take = _taker(ledger_pool, "closed")
    assert await take("a", run="r1")
    assert not await take("b")
    due = await slots.due_for_check(ledger_pool, endpoint="closed", token="b")
    assert due == [slots.Holder("a", "job-a/shard-00000/provider-batch", "r1")]
    # a was described just now: not again for CHECK_EVERY, whoever asks (b was not).
    again = await slots.due_for_check(ledger_pool, endpoint="closed", token="c")
    assert [h.token for h in again] == ["b"]

    # A new run of a's workflow took its token meanwhile: the closed run's row is its.
    assert await take("a", run="r2")
    assert await slots.free_closed(ledger_pool, due) == []
    assert not await take("b")

    assert await slots.free_closed(ledger_pool, [slots.Holder("a", None, "r2")]) == ["a"]
    assert await take("b")


async def test_a_closed_waiter_no_longer_holds_up_those_behind_it(
    ledger_pool: asyncpg.Pool,
) -> None:
    take = _taker(ledger_pool, "waiter")
    assert await take("a")
    assert not await take("b")  # its workflow will be terminated while it waits
    assert not await take("c")
    await slots.release(ledger_pool, token="a")
    assert not await take("c")
    assert await slots.free_closed(ledger_pool, [slots.Holder("b", None, "run-1")]) == ["b"]
    assert await take("c")
