"""The ledger's side of the engine queues (``llm-batch queues``), on a real Postgres."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg

from llmbatch import ledger
from llmbatch.client.queues import WorkerRecord, live_workers
from llmbatch.ledger.backlog import unfinished_by_model
from llmbatch.ledger.served_models import ServedQueue, advertised, served_models
from tests.llmbatch.ledger.test_ledger import new

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


async def _job(pool: asyncpg.Pool, job_id: str, items: int, **spec: str) -> None:
    await ledger.jobs.upsert_job(
        pool, job_id=job_id, spec={"task": "generate", **spec}, model=MODEL, output_uri="out"
    )
    await ledger.items.register_items(pool, job_id=job_id, shard=0, items=new(items))


async def test_a_remote_jobs_items_count_under_its_endpoint_never_the_gpu_queue(
    ledger_pool: asyncpg.Pool,
) -> None:
    await _job(ledger_pool, "own", 3)
    await _job(ledger_pool, "remote", 5, remote_endpoint="fleet")
    await _job(ledger_pool, "provider", 7, remote_endpoint="fleet", via="batch")

    unfinished = await unfinished_by_model(ledger_pool)

    assert unfinished == {(MODEL, "generate", None): (3, 1), (MODEL, "generate", "fleet"): (5, 1)}


async def test_a_stopped_worker_no_longer_serves_its_queue(ledger_pool: asyncpg.Pool) -> None:
    served = ServedQueue(task_queue="q-1", model=MODEL, task="generate", identity="gpu@host")
    async with advertised(ledger_pool, served):
        (row,) = await served_models(ledger_pool)
        assert row.serving(datetime.now(UTC))
    (row,) = await served_models(ledger_pool)
    assert row.stopped_at is not None and not row.serving(datetime.now(UTC))
    # A worker that starts again on the queue serves it again.
    async with advertised(ledger_pool, served):
        (row,) = await served_models(ledger_pool)
        assert row.serving(datetime.now(UTC))


def test_live_workers_leave_out_a_stopped_one_and_keep_a_busy_one() -> None:
    now = 10_000.0
    polled = {"gpu-a": now - 5, "gpu-b": now - 30, "gone": now - 200}
    # gpu-a stopped after its last poll; gpu-c polls no more, every slot busy, its row fresh.
    assert live_workers(polled, WorkerRecord("gpu-a", False, now - 1), now=now) == ["gpu-b"]
    assert live_workers(polled, WorkerRecord("gpu-c", True, None), now=now) == [
        "gpu-a", "gpu-b", "gpu-c"
    ]  # fmt: skip
    # A worker that polled again after it was marked stopped is back.
    assert live_workers(polled, WorkerRecord("gpu-a", False, now - 50), now=now) == [
        "gpu-a", "gpu-b"
    ]  # fmt: skip
