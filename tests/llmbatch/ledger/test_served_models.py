"""What a queue's workers say about the result cache (``served_models``), on the real
Postgres: the render step trusts it only while a worker refreshes it, and never after
the worker that recorded it stopped."""

from __future__ import annotations

import asyncpg

from llmbatch.ledger import served_models
from llmbatch.ledger.served_models import (
    CachePolicy,
    ServedQueue,
    advertised,
    cache_policy,
    record_served_model,
)

POLICY = CachePolicy(weights="sha256:abc", cache=True, shared=False)


def _queue(name: str, *, identity: str = "1@a", policy: CachePolicy = POLICY) -> ServedQueue:
    return ServedQueue(
        task_queue=name, model="m", task="generate", identity=identity, policy=policy
    )


async def test_a_recorded_policy_answers_while_it_is_fresh(ledger_pool: asyncpg.Pool) -> None:
    await record_served_model(ledger_pool, _queue("q-fresh"))
    assert await cache_policy(ledger_pool, task_queue="q-fresh") == POLICY
    assert await cache_policy(ledger_pool, task_queue="q-nobody") is None
    # Not refreshed for longer than POLICY_FRESH_S: its worker may be gone (SIGKILL).
    await ledger_pool.execute(
        "UPDATE served_models SET last_seen = now() - make_interval(secs => $1) "
        "WHERE task_queue = 'q-fresh'",
        served_models.POLICY_FRESH_S + 1,
    )
    assert await cache_policy(ledger_pool, task_queue="q-fresh") is None


async def test_a_worker_without_weights_gives_no_policy(ledger_pool: asyncpg.Pool) -> None:
    unknown = CachePolicy(weights=None, cache=True, shared=False)
    await record_served_model(ledger_pool, _queue("q-unknown", policy=unknown))
    assert await cache_policy(ledger_pool, task_queue="q-unknown") is None


async def test_a_stopping_worker_clears_only_its_own_record(ledger_pool: asyncpg.Pool) -> None:
    async with advertised(ledger_pool, _queue("q-stop")):
        assert await cache_policy(ledger_pool, task_queue="q-stop") == POLICY
    assert await cache_policy(ledger_pool, task_queue="q-stop") is None
    # Another worker of the queue recorded last: the first one's stop leaves it alone.
    other = CachePolicy(weights="sha256:def", cache=False, shared=True)
    async with advertised(ledger_pool, _queue("q-two")):
        await record_served_model(ledger_pool, _queue("q-two", identity="2@b", policy=other))
    assert await cache_policy(ledger_pool, task_queue="q-two") == other
