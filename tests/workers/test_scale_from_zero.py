"""Zero engine workers is a normal state: a job for a model nobody serves waits,
``llm-batch queues`` shows its backlog, and a worker started later finishes it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec, Task
from llmbatch.devstack.demo import settings_env
from llmbatch.ledger.backlog import unfinished_items_query
from tests.fixtures.worker_processes import gpu_worker_process, job_result, stop_worker

pytestmark = pytest.mark.slow

ROWS, SHARD = 200, 50


def _cli(settings: Settings, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", *args],
        env={**os.environ, **settings_env(settings)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


async def _queue(settings: Settings, queue: str) -> dict[str, Any]:
    listed = json.loads(await asyncio.to_thread(_cli, settings, "queues", "--json"))
    return next((q for q in listed if q["task_queue"] == queue), {"backlog": 0})


async def test_a_job_waits_for_a_worker_and_the_queue_shows_its_backlog(
    cpu_workers: Settings, temporal_client: Client, tiny_model_path: Path, tmp_path: Path
) -> None:
    stack = cpu_workers
    model = str(shutil.copytree(tiny_model_path, tmp_path / "tiny-zero"))
    queue = stack.gpu_task_queue(model)
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)))
    spec = JobSpec(
        job_id=f"zero-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model,
        sampling=SamplingSpec(max_tokens=8),
        shard_size=SHARD,
        # Every shard at once: the ledger holds the items of the shards started.
        max_concurrent_shards=ROWS // SHARD,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    pool = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    worker = None
    try:
        handle, _ = await start_job(temporal_client, spec, settings=stack)
        # Accepted and waiting: both shards' generate steps queue on the model's queue.
        for _ in range(300):
            waiting = await _queue(stack, queue)
            if waiting["backlog"] >= ROWS // SHARD:
                break
            await asyncio.sleep(0.5)
        assert waiting["pollers"] == 0
        assert waiting["backlog"] == ROWS // SHARD, waiting
        assert waiting["unfinished_items"] == ROWS
        assert waiting["running_jobs"] == 1
        assert waiting["model"] == model and waiting["task"] == "generate"
        # The query KEDA's postgresql trigger runs counts the same.
        query = unfinished_items_query(model, Task.GENERATE)
        assert await pool.fetchval(query) == ROWS
        status = json.loads(await asyncio.to_thread(_cli, stack, "status", spec.job_id, "--json"))
        assert status["waiting_for_worker"] is True
        assert status["task_queue"] == queue and status["queue_backlog"] == ROWS // SHARD
        text = await asyncio.to_thread(_cli, stack, "status", spec.job_id)
        assert f"waiting for a worker serving {model}" in text
        worker = gpu_worker_process(stack, model, tmp_path / "gpu.log")
        summary = await asyncio.wait_for(job_result(handle), 900)
        finished = await _queue(stack, queue)
        # Stopped, the worker no longer counts: Temporal lists it for minutes after its
        # last poll, which read as a poller with every worker gone.
        stop_worker(worker)
        worker = None
        stopped = await _queue(stack, queue)
    finally:
        if worker is not None:
            stop_worker(worker)
        await pool.close()
    assert (summary.items_succeeded, summary.items_dead) == (ROWS, 0)
    assert finished["unfinished_items"] == 0 and finished["backlog"] == 0
    assert finished["pollers"] == 1
    assert stopped["pollers"] == 0, stopped
    print(f"\nqueue while waiting: {waiting}\nqueue when done: {finished}")
