"""Shared pieces of the remote endpoint tests: the CPU worker in this process (it runs
the workflows), endpoints declared through the CLI, jobs and what came out of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest_asyncio
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.demo import settings_env
from workers.cpu import cpu_worker

KEY_ENV = "LLMBATCH_TEST_ENDPOINT_KEY"


@pytest_asyncio.fixture(scope="session")
async def cpu_only(stack: Settings, temporal_client: Client) -> AsyncIterator[Settings]:
    """The workflows and CPU steps, in this process; the generate steps go to remote
    worker processes."""
    async with cpu_worker(stack, client=temporal_client):
        yield stack


@pytest_asyncio.fixture
async def pool(stack: Settings) -> AsyncIterator[asyncpg.Pool]:
    p = await ledger.create_pool(stack.postgres_dsn.get_secret_value())
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
