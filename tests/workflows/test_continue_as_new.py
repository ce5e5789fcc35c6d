"""A job whose history outgrows one run continues as new and still counts every item.

Temporal suggests continue-as-new only after thousands of events; this test starts a
dev server of its own (Temporal's test environment) whose threshold is 60 events, so
a job of 40 one-row shards crosses it several times.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from llmbatch.client import start_job
from llmbatch.config import Settings
from llmbatch.contract import search_attributes
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.engine import Engine
from workers.cpu import cpu_worker
from workers.gpu import gpu_worker

pytestmark = pytest.mark.slow


@pytest_asyncio.fixture
async def small_history_env(stack: Settings) -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        namespace=stack.temporal_namespace,
        data_converter=pydantic_data_converter,
        search_attributes=list(search_attributes.ALL),
        dev_server_existing_path=shutil.which("temporal")
        or str(Path(__import__("sys").executable).parent / "temporal"),
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=60",
        ],
    )
    try:
        yield env
    finally:
        await env.shutdown()


async def test_long_job_continues_as_new_and_counts_every_item(
    stack: Settings,
    small_history_env: WorkflowEnvironment,
    engine: Engine,
    model_name: str,
    tmp_path: Path,
) -> None:
    client = small_history_env.client
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"n": {i}}}\n' for i in range(40)))
    spec = JobSpec(
        job_id=f"can-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Number {{ n }}")],
        model=model_name,
        sampling=SamplingSpec(choice=["odd", "even"], max_tokens=4),
        shard_size=1,
        max_concurrent_shards=3,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    async with (
        cpu_worker(stack, client=client),
        gpu_worker(stack, engine, model=model_name, client=client),
    ):
        handle, _ = await start_job(client, spec, settings=stack)
        summary = await asyncio.wait_for(handle.result(), 300)

    assert (summary.shards_done, summary.items_succeeded, summary.items_dead) == (40, 40, 0)
    runs = [e.status async for e in client.list_workflows(f"WorkflowId = '{spec.job_id}'")]
    assert runs.count(WorkflowExecutionStatus.CONTINUED_AS_NEW) >= 2
    assert runs.count(WorkflowExecutionStatus.COMPLETED) == 1
    assert len(list((tmp_path / "out" / spec.job_id).glob("part-*.jsonl"))) == 40
