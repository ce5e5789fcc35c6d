"""Shared pieces of the remote endpoint tests: the CPU worker in this process (it runs
the workflows), endpoints declared through the CLI, jobs and what came out of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowHandle

from llmbatch import ledger
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress
from llmbatch.contract.names import PROGRESS_QUERY
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import settings_env, wait_for_pollers
from llmbatch.devstack.process import LoggedProcess
from tests.fixtures.openai_server import CANARY_KEY, remote_worker_process
from tests.fixtures.worker_processes import stop_worker

KEY_ENV = "LLMBATCH_TEST_ENDPOINT_KEY"


@pytest.fixture
def cpu_only(cpu_workers: Settings) -> Settings:
    """The workflows and CPU steps, in this process (the session's); the generate
    steps go to remote worker processes."""
    return cpu_workers


@pytest_asyncio.fixture
async def pool(stack: Settings) -> AsyncIterator[asyncpg.Pool]:
    p = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    try:
        yield p
    finally:
        await p.close()


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """``llm-batch ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", *args],
        env={**os.environ, **settings_env(settings)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def add_endpoint(settings: Settings, base_url: str, *options: str) -> str:
    """A new endpoint (a name of its own per test), declared with the CLI."""
    name = f"ep-{uuid.uuid4().hex[:8]}"
    done = cli(
        settings, "endpoint", "add", name, "--base-url", base_url, "--api-key-env", KEY_ENV,
        *options,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return name


def job(
    tmp_path: Path,
    *,
    endpoint: str,
    model: str,
    rows: list[dict[str, Any]],
    shard_size: int = 20,
    max_tokens: int = 8,
    prefix: str = "remote",
) -> JobSpec:
    source = tmp_path / f"{prefix}-rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return JobSpec(
        job_id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="{{ text }}")],
        model=model,
        remote_endpoint=endpoint,
        sampling=SamplingSpec(max_tokens=max_tokens),
        shard_size=shard_size,
        max_concurrent_shards=4,
        output_uri=f"file://{tmp_path / 'out'}",
    )


def output_ids(tmp_path: Path, job_id: str) -> list[str]:
    """Every item id in the job's output parts (an item twice appears twice)."""
    return [
        json.loads(line)["item_id"]
        for part in sorted((tmp_path / "out" / job_id).glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]


@contextlib.asynccontextmanager
async def remote_workers(
    settings: Settings,
    client: Client,
    *,
    endpoint: str,
    model: str,
    logs: Sequence[Path],
) -> AsyncIterator[list[LoggedProcess]]:
    """One ``llm-batch worker remote`` per log, with the canary key, polling before the
    block starts and stopped after it."""
    procs = [
        remote_worker_process(settings, endpoint, log, env={KEY_ENV: CANARY_KEY}) for log in logs
    ]
    try:
        queue = settings.gpu_task_queue(model, endpoint=endpoint)
        await wait_for_pollers(client, [queue], procs=procs, within_s=180)
        yield procs
    finally:
        for proc in procs:
            stop_worker(proc)


async def until_paused(handle: WorkflowHandle[Any, Any], *, within_s: float) -> JobProgress:
    """The job's progress once it shows paused (or after ``within_s``)."""
    progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    for _ in range(int(within_s / 0.5)):
        if progress.paused:
            break
        await asyncio.sleep(0.5)
        progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    return progress
