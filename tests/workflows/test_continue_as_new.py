"""A job whose history outgrows one run continues as new and still counts every item.

Temporal suggests continue-as-new only after thousands of events; this test starts a
dev server of its own (tests/fixtures/small_history.py) whose threshold is 60 events,
so a job of 40 one-row shards crosses it several times.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.engine.vllm_engine import Engine
from llmbatch.workers.cpu import cpu_worker
from llmbatch.workers.gpu import gpu_worker
from tests.fixtures.small_history import one_row_shard_job, small_history_env

pytestmark = pytest.mark.slow


async def test_long_job_continues_as_new_and_counts_every_item(
    stack: Settings, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"n": {i}}}\n' for i in range(40)))
    spec = one_row_shard_job(f"can-{uuid.uuid4().hex[:8]}", source, model_name, tmp_path / "out")
    async with small_history_env(stack) as env:
        client = env.client
        async with (
            cpu_worker(stack, client=client),
            gpu_worker(stack, engine, model=model_name, client=client),
        ):
            handle, _ = await start_job(client, spec, settings=stack)
            summary = await asyncio.wait_for(handle.result(), 300)
        runs = [e.status async for e in client.list_workflows(f"WorkflowId = '{spec.job_id}'")]

    assert (summary.shards_done, summary.items_succeeded, summary.items_dead) == (40, 40, 0)
    assert runs.count(WorkflowExecutionStatus.CONTINUED_AS_NEW) >= 2
    assert runs.count(WorkflowExecutionStatus.COMPLETED) == 1
    assert len(list((tmp_path / "out" / spec.job_id).glob("part-*.jsonl"))) == 40
