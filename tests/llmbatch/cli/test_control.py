"""watch, list, cancel, pause and resume against running jobs on the session's stack.

The commands run as real ``llm-batch`` processes (``cli`` from test_jobs) while the
workers run in this test process's event loop. What a job did is read back from the
ledger, the source of truth for "done".
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import PROGRESS_QUERY
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.process import free_port
from llmbatch.engine.vllm_engine import Engine
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 600
# Unconstrained text up to this many tokens: slow enough per item (the tiny model's
# random weights rarely stop early) that a job of a few thousand rows is still
# generating when the test pauses or cancels it.
SLOW_MAX_TOKENS = 64


@pytest_asyncio.fixture
async def pool(workers: Settings) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the ledger the session's workers write to."""
    p = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value(), max_size=2)
    try:
        yield p
    finally:
        await p.close()


async def start_running_job(
    client: Client,
    settings: Settings,
    tmp_path: Path,
    model: str,
    *,
    rows: int,
    shard_size: int,
    max_concurrent_shards: int = 1,
    max_tokens: int = SLOW_MAX_TOKENS,
) -> tuple[JobSpec, WorkflowHandle[Any, JobSummary]]:
    source = tmp_path / f"tickets-{uuid.uuid4().hex[:6]}.jsonl"
    source.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(rows)))
    spec = JobSpec(
        job_id=f"ctl-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Summarise: {{ text }}")],
        model=model,
        sampling=SamplingSpec(max_tokens=max_tokens),
        shard_size=shard_size,
        max_concurrent_shards=max_concurrent_shards,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    handle, started = await start_job(client, spec, settings=settings)
    assert started
    return spec, handle


async def eventually(
    check: Callable[[], Awaitable[Any]], *, within_s: float, every_s: float = 0.5
) -> Any:
    """Await ``check()`` until it returns something truthy; fail after ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"not within {within_s} s"
        await asyncio.sleep(every_s)


async def some_succeeded(pool: asyncpg.Pool, job: str) -> ledger.jobs.JobCounts | None:
    counts = await ledger.jobs.job_counts(pool, job_id=job)
    return counts if counts.succeeded > 0 else None


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, (code, err)
    return lines[0]


async def test_watch_follows_a_running_job_to_the_end_and_list_shows_it(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    spec, _ = await start_running_job(
        temporal_client, workers, tmp_path, model_name, rows=1200, shard_size=200,
        max_concurrent_shards=2, max_tokens=8,
    )  # fmt: skip
    job = spec.job_id

    (code, out, err), (jcode, jout, jerr) = await asyncio.gather(
        cli(workers, "watch", job, "--interval", "1"),
        cli(workers, "watch", job, "--interval", "1", "--json"),
    )

    # Output is a pipe, not a terminal: plain lines, no bar, no escape codes.
    assert code == 0, err
    assert "\x1b" not in out and "━" not in out
    progress_lines = [line for line in out.splitlines() if f" {job} " in line and "items" in line]
    assert progress_lines, out
    assert any(f"{job} running:" in line and "items/s" in line for line in progress_lines)
    assert f"{job} succeeded: 1200/1200 items (100%), 0 dead" in progress_lines[-1]
    assert "items: 1200 total, 1200 succeeded, 0 dead" in out

    assert jcode == 0, jerr
    records = [json.loads(line) for line in jout.splitlines()]
    *readings, summary = records
    assert {r["type"] for r in readings} == {"progress"} and summary["type"] == "summary"
    assert summary["items_succeeded"] == 1200 and summary["state"] == "succeeded"
    done = [r["items_done"] for r in readings]
    assert done == sorted(done) and readings[-1]["items_done"] == 1200
    assert all(r["job_id"] == job for r in readings)

    async def listed() -> dict[str, Any] | None:
        code, out, err = await cli(workers, "list", "--json", "--limit", "100")
        assert code == 0, err
        rows = {r["job_id"]: r for r in json.loads(out)}
        row = rows.get(job)
        # Visibility is updated a moment after the job closes.
        return row if row and row["status"] == "completed" and row["items_done"] else None

    row = await eventually(listed, within_s=30)
    assert (row["items_total"], row["items_done"], row["items_dead"]) == (1200, 1200, 0)
    assert row["model"] == model_name and row["age_s"] >= 0

    code, out, _ = await cli(workers, "list", "--limit", "100")
    assert code == 0
    line = next(line for line in out.splitlines() if job in line)
    assert "completed" in line and "1200/1200 100%" in line


async def test_pause_holds_a_running_job_and_resume_lets_it_finish(
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
    pool: asyncpg.Pool,
) -> None:
    # Two shards, one at a time: pausing in the first must stop its generate mid-way
    # (shards not started yet are simply not started).
    rows, shard_size = 6000, 3000
    spec, handle = await start_running_job(
        temporal_client, workers, tmp_path, model_name, rows=rows, shard_size=shard_size
    )
    job = spec.job_id
    await eventually(lambda: some_succeeded(pool, job), within_s=JOB_TIMEOUT_S)

    code, out, err = await cli(workers, "pause", job, "--json")
    assert code == 0, err
    assert json.loads(out) == {"job_id": job, "state": "paused", "paused": True}

    # Requests already in the engine finish; then nothing more may succeed.
    before = await ledger.jobs.job_counts(pool, job_id=job)
    while True:
        await asyncio.sleep(4)
        now = await ledger.jobs.job_counts(pool, job_id=job)
        if now.succeeded == before.succeeded:
            break
        assert now.succeeded < rows, "the job ran to the end though it was paused"
        before = now
    await asyncio.sleep(8)  # several times what a running attempt takes to see the flag
    held = await ledger.jobs.job_counts(pool, job_id=job)
    assert held.succeeded == before.succeeded, "items kept succeeding while paused"
    assert 0 < held.succeeded < shard_size, "the running shard's generate did not hold"
    assert held.running > 0  # claimed by the paused attempt, which still heartbeats

    p = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    assert (p.state, p.paused) == ("paused", True)
    code, out, err = await cli(workers, "list", "--json", "--limit", "100")
    assert code == 0, err
    assert {r["job_id"]: r["state"] for r in json.loads(out)}[job] == "paused"
    code, out, _ = await cli(workers, "status", job, "--json")
    assert json.loads(out)["state"] == "paused"
    code, out, _ = await cli(workers, "pause", job)  # again: still paused, no error
    assert code == 0 and "paused" in out

    code, out, err = await cli(workers, "resume", job, "--json")
    assert code == 0, err
    assert json.loads(out) == {"job_id": job, "state": "running", "paused": False}

    summary = await asyncio.wait_for(handle.result(), JOB_TIMEOUT_S)
    assert (summary.state, summary.items_succeeded, summary.paused) == ("succeeded", rows, False)
    counts = await ledger.jobs.job_counts(pool, job_id=job)
    assert (counts.total, counts.succeeded, counts.running) == (rows, rows, 0)
    assert not await ledger.jobs.job_paused(pool, job_id=job)

    code, _, err = await cli(workers, "resume", job)
    assert "not running (completed)" in one_error_line(code, err)


async def test_cancel_stops_a_running_job_and_keeps_its_partial_results(
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
    pool: asyncpg.Pool,
    engine: Engine,
) -> None:
    # One shard, so every item is registered (and its generate running) when we cancel.
    rows = 6000
    spec, handle = await start_running_job(
        temporal_client, workers, tmp_path, model_name, rows=rows, shard_size=rows
    )
    job = spec.job_id
    await eventually(lambda: some_succeeded(pool, job), within_s=JOB_TIMEOUT_S)
    # Paused, the running generate holds its claimed items and sends no more to the
    # engine (it reads the flag every 2 s); the cancel reaches it only with a
    # heartbeat (up to ~24 s). Without the pause a fast engine could finish the
    # whole shard first, and the test would measure the engine, not the cancel.
    code, _, err = await cli(workers, "pause", job)
    assert code == 0, err

    code, out, err = await cli(workers, "cancel", job, "--json")
    assert code == 0, err
    assert json.loads(out)["status"] == "canceled"
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert isinstance(failure.value.cause, CancelledError)

    # The shard's generate sees the cancel on its next heartbeat, aborts what is in
    # the engine, keeps the results that came back and gives the other items back.
    shard = temporal_client.get_workflow_handle(f"{job}/shard-00000")

    async def shard_closed() -> bool:
        return (await shard.describe()).status != WorkflowExecutionStatus.RUNNING

    await eventually(shard_closed, within_s=120)
    assert (await shard.describe()).status == WorkflowExecutionStatus.CANCELED
    counts = await ledger.jobs.job_counts(pool, job_id=job)
    assert counts.total == rows and counts.running == 0
    assert 0 < counts.succeeded < rows and counts.pending == rows - counts.succeeded - counts.dead
    assert engine.num_unfinished_requests == 0
    await asyncio.sleep(5)
    assert (await ledger.jobs.job_counts(pool, job_id=job)).succeeded == counts.succeeded

    code, _, err = await cli(workers, "cancel", job)
    assert "not running (canceled)" in one_error_line(code, err)


async def test_control_errors_are_one_line_and_exit_1(workers: Settings) -> None:
    for command in ("watch", "cancel", "pause", "resume", "status"):
        code, _, err = await cli(workers, command, "no-such-job")
        assert "no job 'no-such-job'" in one_error_line(code, err), command
    for command in ("watch", "cancel", "pause"):
        code, _, err = await cli(workers, command, "no-such-job", "--json")
        assert "no job 'no-such-job'" in one_error_line(code, err), command

    nowhere = workers.model_copy(update={"temporal_address": f"127.0.0.1:{free_port()}"})
    for args in (("list",), ("list", "--json"), ("pause", "some-job"), ("watch", "some-job")):
        code, _, err = await cli(nowhere, *args)
        assert "cannot reach Temporal" in one_error_line(code, err), args
