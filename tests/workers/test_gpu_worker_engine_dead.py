"""A dead vLLM engine ends the GPU worker with exit code 1; the job goes on elsewhere.

The fault comes from outside: SIGKILL of the worker's EngineCore process, as an
out-of-memory kill or a crashed GPU driver would end it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import psutil
import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.worker_processes import (
    gpu_worker_process,
    job_result,
    stop_worker,
    until_done,
)

pytestmark = pytest.mark.slow

ROWS = 2000


def engine_core(worker_pid: int) -> psutil.Process:
    for child in psutil.Process(worker_pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError(f"no EngineCore process under worker {worker_pid}")


async def test_dead_engine_exits_the_worker_and_the_job_completes(
    workers: Settings, temporal_client: Client, tiny_model_path: Path, tmp_path: Path
) -> None:
    stack = workers
    model = str(shutil.copytree(tiny_model_path, tmp_path / "tiny-dead-engine"))
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)))
    spec = JobSpec(
        job_id=f"engine-dead-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model,
        sampling=SamplingSpec(max_tokens=24, temperature=1.0, seed=2),
        shard_size=500,
        max_concurrent_shards=2,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    pool = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    first = gpu_worker_process(stack, model, tmp_path / "gpu-1.log")
    second = None
    try:
        await wait_for_pollers(
            temporal_client, [stack.gpu_task_queue(model)], procs=[first], within_s=300
        )
        handle, _ = await start_job(temporal_client, spec, settings=stack)
        await until_done(pool, spec.job_id, ROWS // 5)
        engine_core(first.pid).kill()

        code = await asyncio.wait_for(asyncio.to_thread(first.wait), 120)
        second = gpu_worker_process(stack, model, tmp_path / "gpu-2.log")
        summary = await asyncio.wait_for(job_result(handle), 900)
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_worker(proc)
        await pool.close()

    assert code == 1, (tmp_path / "gpu-1.log").read_text()[-2000:]
    assert "engine died" in (tmp_path / "gpu-1.log").read_text()
    assert (summary.items_succeeded, summary.items_dead) == (ROWS, 0)
