"""A shard's generate step runs on the model its job names, or its items die saying why.

On the real stack: the session's GPU worker serves the tiny model; each test runs
its jobs on a CPU worker of its own (own queue, own settings), so a short
schedule-to-start limit or a mislabelled GPU worker touches no other test's jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import DeadLetterEntry
from llmbatch.contract.messages import JobSummary
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.contract.states import ErrorClass, JobState
from llmbatch.workers.cpu import cpu_worker

if TYPE_CHECKING:
    from llmbatch.engine.vllm_engine import Engine

pytestmark = pytest.mark.slow

ROWS = 12
JOB_TIMEOUT_S = 300


@contextlib.asynccontextmanager
async def own_cpu_worker(
    stack: Settings, client: Client, **settings: Any
) -> AsyncIterator[Settings]:
    """A CPU worker (workflows, plan, fetch, render, write) on a queue of its own with
    ``settings`` changed; yields the settings to start jobs with."""
    own = stack.model_copy(
        update={"cpu_task_queue": f"shard-{uuid.uuid4().hex[:8]}-cpu", **settings}
    )
    async with cpu_worker(own, client=client):
        yield own


def job(tmp_path: Path, model: str) -> JobSpec:
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)))
    return JobSpec(
        job_id=f"routing-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Count to {{ n }}.")],
        model=model,
        sampling=SamplingSpec(max_tokens=4),
        output_uri=f"file://{tmp_path / 'out'}",
        shard_size=6,
    )


async def run(client: Client, settings: Settings, spec: JobSpec) -> JobSummary:
    handle, _ = await start_job(client, spec, settings=settings)
    return await asyncio.wait_for(handle.result(), JOB_TIMEOUT_S)


async def dead_items(settings: Settings, job_id: str) -> list[DeadLetterEntry]:
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        return await ledger.dead_letters.dead_items(pool, job_id=job_id)
    finally:
        await pool.close()


async def test_a_model_with_the_served_models_name_elsewhere_waits_for_its_own_worker(
    workers: Settings, temporal_client: Client, model_name: str, tmp_path: Path
) -> None:
    # Same last path segment as the served model ('tiny-llama'), another model: named
    # from that segment alone, its queue was the served model's and the job ran there.
    elsewhere = f"/elsewhere/{Path(model_name).name}"
    async with own_cpu_worker(
        workers, temporal_client, generate_schedule_to_start=timedelta(seconds=3)
    ) as own:
        spec = job(tmp_path, elsewhere)
        summary = await run(temporal_client, own, spec)

    assert summary.state == JobState.FAILED
    assert (summary.items_succeeded, summary.items_dead) == (0, ROWS)
    dead = await dead_items(own, spec.job_id)
    assert {d.error_class for d in dead} == {ErrorClass.NO_WORKER}
    assert all(f"no worker served model {elsewhere} within 3s" in d.message for d in dead)


async def test_a_worker_refuses_a_shard_for_another_model_and_its_items_die(
    workers: Settings,
    temporal_client: Client,
    engine: Engine,
    model_name: str,
    tmp_path: Path,
) -> None:
    from llmbatch.workers.gpu import gpu_worker

    # A GPU worker that polls another model's queue with the tiny model loaded: how a
    # shard for the wrong model reaches an engine (a misconfigured deployment, or any
    # client starting activities on a queue by name).
    other = "/models/another-model"
    async with (
        own_cpu_worker(
            workers, temporal_client, gpu_task_queue_prefix=f"wrong-{uuid.uuid4().hex[:8]}"
        ) as own,
        gpu_worker(own, engine, model=other, client=temporal_client),
    ):
        spec = job(tmp_path, other)
        summary = await asyncio.wait_for(run(temporal_client, own, spec), 120)

    assert summary.state == JobState.FAILED
    assert (summary.items_succeeded, summary.items_dead) == (0, ROWS)
    dead = await dead_items(own, spec.job_id)
    assert {d.error_class for d in dead} == {ErrorClass.WRONG_MODEL}
    assert all(other in d.message and model_name in d.message for d in dead)
