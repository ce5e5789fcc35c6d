"""A job that never finalizes still ends in the ledger: ``cancelled`` or ``failed``.

The jobs row is written by plan_job with status ``running`` and, before, only
finalize_job changed it: a cancelled job, or one that failed after planning, said
``running`` for ever. Here a real CPU worker runs the jobs on queues of its own, with
no GPU worker for their model, so a shard waits at generate for as long as the test
wants; its items stay ``pending``, as they are.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import CancelledError

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, RetrySpec
from llmbatch.contract.states import JobState
from llmbatch.workers.cpu import cpu_worker

ROWS = 5
GUARD_S = 120.0
POLL_S = 0.1


@pytest_asyncio.fixture
async def cpu_only(stack: Settings, temporal_client: Client) -> AsyncIterator[Settings]:
    """A CPU worker on queues of its own; nothing polls its GPU queue."""
    tag = uuid.uuid4().hex[:8]
    settings = stack.model_copy(
        update={"cpu_task_queue": f"end-{tag}", "gpu_task_queue_prefix": f"end-{tag}-gpu"}
    )
    async with cpu_worker(settings, client=temporal_client):
        yield settings


@pytest_asyncio.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await ledger.db.create_pool(pg_dsn, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


def spec_for(tmp_path: Path, rows: int) -> JobSpec:
    source = tmp_path / "in" / "rows.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text("".join(f'{{"n": {i}}}\n' for i in range(rows)))
    return JobSpec(
        job_id=f"end-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Say {{ n }}")],
        model="no-worker-has-this-model",
        output_uri=f"file://{tmp_path / 'out'}",
        retry=RetrySpec(max_activity_attempts=1),
    )


async def job_status(pool: asyncpg.Pool, job_id: str) -> str | None:
    status: str | None = await pool.fetchval("SELECT status FROM jobs WHERE job_id = $1", job_id)
    return status


async def test_a_cancelled_job_ends_cancelled_in_the_ledger(
    cpu_only: Settings, temporal_client: Client, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path, ROWS)
    handle, _ = await start_job(temporal_client, spec, settings=cpu_only)
    # Planned (the row exists) and its items registered: the shard waits at generate.
    for _ in range(int(GUARD_S / POLL_S)):
        if (await ledger.jobs.job_counts(pool, job_id=spec.job_id)).total == ROWS:
            break
        await asyncio.sleep(POLL_S)
    else:
        raise TimeoutError(f"{spec.job_id}: items not registered within {GUARD_S} s")
    assert await job_status(pool, spec.job_id) == JobState.RUNNING

    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await asyncio.wait_for(handle.result(), GUARD_S)
    assert isinstance(ended.value.cause, CancelledError)

    # Recorded before the workflow ended; the items are left as they were.
    assert await job_status(pool, spec.job_id) == JobState.CANCELLED
    counts = await ledger.jobs.job_counts(pool, job_id=spec.job_id)
    assert counts.pending == ROWS and counts.total == ROWS


async def test_a_job_that_fails_after_planning_ends_failed_in_the_ledger(
    stack: Settings, temporal_client: Client, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Its one shard finds no worker for its model within a second, so its items die;
    then the manifest cannot be written, since a folder stands where it goes. With
    one attempt allowed, finalize_job fails, and the job with it."""
    tag = uuid.uuid4().hex[:8]
    settings = stack.model_copy(
        update={
            "cpu_task_queue": f"end-{tag}",
            "gpu_task_queue_prefix": f"end-{tag}-gpu",
            "generate_schedule_to_start": timedelta(seconds=1),
        }
    )
    spec = spec_for(tmp_path, 1)
    (tmp_path / "out" / spec.job_id / "manifest.json").mkdir(parents=True)
    async with cpu_worker(settings, client=temporal_client):
        handle, _ = await start_job(temporal_client, spec, settings=settings)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), GUARD_S)

    assert await job_status(pool, spec.job_id) == JobState.FAILED
