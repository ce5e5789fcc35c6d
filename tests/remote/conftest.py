"""Shared pieces of the remote endpoint tests: the CPU worker in this process (it runs
the workflows), endpoints declared through the CLI, jobs and what came out of them,
and :class:`RemoteCase`, the parts one end-to-end test uses, as one fixture."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowHandle

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import PROGRESS_QUERY
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import settings_env, wait_for_pollers
from llmbatch.devstack.process import LoggedProcess
from tests.fixtures.openai_server import CANARY_KEY, Gateway, OpenAIServer, remote_worker_process
from tests.fixtures.worker_processes import job_result, stop_worker
from tests.llmbatch.api.helpers import lines_of, until

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


async def batch_on_endpoint(
    client: openai.AsyncOpenAI,
    batch_id: str,
    lines: list[dict[str, Any]],
    *,
    settings: Settings,
    temporal_client: Client,
    endpoint: str,
    model: str,
    log: Path,
) -> list[dict[str, Any]]:
    """The output lines of batch ``batch_id`` (of request ``lines``) once one remote
    worker of ``endpoint`` has run it: completed, every line once and answered 200."""
    async with remote_workers(
        settings, temporal_client, endpoint=endpoint, model=model, logs=[log]
    ):
        batch = await until(
            client, batch_id, lambda b: b.status not in ("validating", "in_progress", "finalizing")
        )
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    total = len(lines)
    assert batch.request_counts.model_dump() == {"total": total, "completed": total, "failed": 0}
    out = await lines_of(client, batch.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
    return out


async def until_paused(handle: WorkflowHandle[Any, Any], *, within_s: float) -> JobProgress:
    """The job's progress once it shows paused (or after ``within_s``)."""
    progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    for _ in range(int(within_s / 0.5)):
        if progress.paused:
            break
        await asyncio.sleep(0.5)
        progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    return progress


@dataclass(frozen=True)
class RemoteCase:
    """What an end-to-end remote test works with: the stack (its workflows and CPU
    steps in this process), the Temporal client, vLLM's server, a gateway in front of
    it checking the canary key, a ledger pool and the test's folder."""

    settings: Settings
    client: Client
    server: OpenAIServer
    gateway: Gateway
    pool: asyncpg.Pool
    folder: Path
    # Worker processes started with :meth:`worker`, stopped when the test ends.
    started: list[LoggedProcess] = field(default_factory=list)

    def endpoint(self, *options: str, base_url: str | None = None) -> str:
        """A new endpoint at the gateway (or ``base_url``), declared with the CLI."""
        return add_endpoint(self.settings, base_url or self.gateway.base_url, *options)

    def job(self, endpoint: str, rows: list[dict[str, Any]], **options: Any) -> JobSpec:
        """A chat job of ``rows`` on ``endpoint`` (see :func:`job` for ``options``)."""
        return job(self.folder, endpoint=endpoint, model=self.server.model, rows=rows, **options)

    def workers(
        self, endpoint: str, *, count: int = 1
    ) -> contextlib.AbstractAsyncContextManager[list[LoggedProcess]]:
        """``count`` remote workers of ``endpoint``, polling (logs remote-N.log)."""
        logs = [self.folder / f"remote-{n}.log" for n in range(count)]
        return remote_workers(
            self.settings, self.client, endpoint=endpoint, model=self.server.model, logs=logs
        )

    def worker(
        self, endpoint: str, name: str, *args: str, env: dict[str, str] | None = None
    ) -> LoggedProcess:
        """One ``llm-batch worker remote`` (``args`` added) with the canary key (and
        ``env``), its log ``NAME.log``; stopped at the end of the test at the latest."""
        proc = remote_worker_process(
            self.settings,
            endpoint,
            self.folder / f"{name}.log",
            *args,
            env={KEY_ENV: CANARY_KEY, **(env or {})},
        )
        self.started.append(proc)
        return proc

    async def polling(self, endpoint: str, procs: Sequence[LoggedProcess]) -> None:
        """Until ``procs`` poll the endpoint's queue for the server's model."""
        queue = self.settings.gpu_task_queue(self.server.model, endpoint=endpoint)
        await wait_for_pollers(self.client, [queue], procs=procs, within_s=180)

    async def start(self, spec: JobSpec) -> WorkflowHandle[Any, Any]:
        handle, _ = await start_job(self.client, spec, settings=self.settings)
        return handle

    async def run(self, spec: JobSpec, *, within_s: float = 300) -> JobSummary:
        """Start the job and wait for its summary."""
        return await asyncio.wait_for(job_result(await self.start(spec)), within_s)

    def output_ids(self, job_id: str) -> list[str]:
        return output_ids(self.folder, job_id)

    def assert_exactly_once(self, spec: JobSpec, summary: JobSummary, items: int) -> None:
        """Every item succeeded and is in the output once."""
        assert (summary.items_succeeded, summary.items_dead) == (items, 0)
        ids = self.output_ids(spec.job_id)
        assert len(ids) == items and len(set(ids)) == items


@pytest.fixture
def remote(
    cpu_only: Settings,
    temporal_client: Client,
    openai_server: OpenAIServer,
    gateway: Gateway,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> Iterator[RemoteCase]:
    case = RemoteCase(cpu_only, temporal_client, openai_server, gateway, pool, tmp_path)
    try:
        yield case
    finally:
        for proc in case.started:
            stop_worker(proc)
