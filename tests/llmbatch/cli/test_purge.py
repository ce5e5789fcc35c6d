"""``llm-batch purge`` as a real process against the session's stack: a finished job's
ledger rows go (by job and by age), while another job runs beside it untouched and
still completes exactly once; its outputs in storage stay; a purged job is never
re-driven."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from tests.llmbatch.cli.test_control import (
    JOB_TIMEOUT_S,
    eventually,
    one_error_line,
    pool,  # noqa: F401  (the fixture)
    some_succeeded,
    start_running_job,
)
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

ITEM_COLUMNS = (
    "item_id, shard, status, attempt, lease_owner, result, prompt_hash, updated_at, finished_at"
)


async def ledger_rows(db: asyncpg.Pool, job: str) -> dict[str, int]:
    """How many rows of each per-job table the ledger holds for ``job``."""
    counts = {}
    for table in ("items", "dead_letters", "shards", "dedup_leads"):
        counts[table] = await db.fetchval(
            f"SELECT count(*) FROM {table} WHERE job_id = $1",
            job,
        )
    return counts


async def item_snapshot(db: asyncpg.Pool, job: str) -> list[dict[str, Any]]:
    rows = await db.fetch(
        f"SELECT {ITEM_COLUMNS} FROM items WHERE job_id = $1 ORDER BY item_id",
        job,
    )
    return [dict(r) for r in rows]


async def held(db: asyncpg.Pool, job: str) -> list[dict[str, Any]]:
    """The paused job's rows once nothing of it changes any more (requests already in
    the engine finish after the pause)."""
    before = await item_snapshot(db, job)
    while True:
        await asyncio.sleep(4)
        now = await item_snapshot(db, job)
        if now == before:
            return now
        before = now


async def test_purge_by_job_and_age_beside_a_running_job(
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
    pool: asyncpg.Pool,  # noqa: F811
) -> None:
    # B runs (paused, so it is still running whatever the machine's speed) while A,
    # a small job with one dead row, runs to its end and is purged.
    rows_b = 3000
    spec_b, handle_b = await start_running_job(
        temporal_client, workers, tmp_path, model_name, rows=rows_b, shard_size=1000
    )
    job_b = spec_b.job_id
    await eventually(lambda: some_succeeded(pool, job_b), within_s=JOB_TIMEOUT_S)
    code, _, err = await cli(workers, "pause", job_b)
    assert code == 0, err

    source = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"note {i}"}) for i in range(30)] + [json.dumps({"other": 1})]
    source.write_text("\n".join(lines) + "\n")
    spec_a = JobSpec(
        job_id=f"purge-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Label: {{ text }}")],
        model=model_name,
        sampling=SamplingSpec(max_tokens=4),
        shard_size=10,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    handle_a, started = await start_job(temporal_client, spec_a, settings=workers)
    assert started
    summary_a = await asyncio.wait_for(handle_a.result(), JOB_TIMEOUT_S)
    job_a = spec_a.job_id
    assert (summary_a.items_succeeded, summary_a.items_dead) == (30, 1)
    parts_a = sorted((tmp_path / "out" / job_a).rglob("*.jsonl"))
    outputs_a = {p: p.read_bytes() for p in parts_a}
    assert parts_a
    assert await ledger_rows(pool, job_a) == {
        "items": 31, "dead_letters": 1, "shards": 4, "dedup_leads": 0,
    }  # fmt: skip

    before_b = await held(pool, job_b)
    assert 0 < sum(r["status"] == "succeeded" for r in before_b) < rows_b

    # A running (here paused) job is refused, and so is one the ledger does not know;
    # a refused name stops the command before anything is deleted.
    code, _, err = await cli(workers, "purge", "--job", job_b)
    assert f"job {job_b!r} is running: only finished jobs are purged" in one_error_line(code, err)
    code, _, err = await cli(workers, "purge", "--job", job_a, "--job", "no-such-job")
    assert "no job 'no-such-job' in the ledger" in one_error_line(code, err)
    assert (await ledger_rows(pool, job_a))["items"] == 31

    # By age: A ended "40 days ago"; a running job has no end and is never chosen.
    await pool.execute(
        "UPDATE jobs SET finished_at = now() - interval '40 days' WHERE job_id = $1", job_a
    )
    code, out, err = await cli(workers, "purge", "--older-than", "30d", "--json")
    assert code == 0, err
    purged = {p["job_id"]: p for p in json.loads(out)}
    assert set(purged) == {job_a}
    assert purged[job_a]["state"] == "completed_with_errors"
    removed = {k: purged[job_a][k] for k in ("items", "dead_letters", "shards", "dedup_leads")}
    assert removed == {"items": 31, "dead_letters": 1, "shards": 4, "dedup_leads": 0}
    assert await ledger_rows(pool, job_a) == dict.fromkeys(removed, 0)
    job_row = await pool.fetchrow(
        "SELECT status, items_succeeded, items_dead, purged_at FROM jobs WHERE job_id = $1", job_a
    )
    assert job_row is not None and job_row["purged_at"] is not None
    assert (job_row["status"], job_row["items_succeeded"], job_row["items_dead"]) == (
        "completed_with_errors", 30, 1,
    )  # fmt: skip
    assert {p: p.read_bytes() for p in parts_a} == outputs_a  # outputs are not the ledger's

    # Again, by job: nothing left, said plainly; by age: A is not chosen twice.
    code, out, err = await cli(workers, "purge", "--job", job_a)
    assert code == 0, err
    assert f"purged {job_a} (completed_with_errors, ended " in out
    assert ": 0 items, 0 dead letters, 0 shards, 0 dedup leads" in out
    code, out, _ = await cli(workers, "purge", "--older-than", "30d")
    assert code == 0 and out.strip() == "purged 0 jobs, 0 items"
    # A re-drive of a purged job finds nothing to run.
    requeued = await ledger.dead_letters.requeue_dead(pool, job_id=job_a)
    assert requeued.item_ids == [] and requeued.shards == []

    # B's rows were not touched; resumed, it completes exactly once.
    assert await item_snapshot(pool, job_b) == before_b
    code, _, err = await cli(workers, "resume", job_b)
    assert code == 0, err
    summary_b = await asyncio.wait_for(handle_b.result(), JOB_TIMEOUT_S)
    assert (summary_b.state, summary_b.items_succeeded) == ("succeeded", rows_b)
    after_b = await item_snapshot(pool, job_b)
    assert len(after_b) == rows_b and {r["status"] for r in after_b} == {"succeeded"}
    out_ids = [
        json.loads(line)["item_id"]
        for part in sorted((tmp_path / "out" / job_b).glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    assert len(out_ids) == rows_b and len(set(out_ids)) == rows_b
    done_before = {r["item_id"]: r["result"] for r in before_b if r["status"] == "succeeded"}
    assert {r["item_id"]: r["result"] for r in after_b if r["item_id"] in done_before} == (
        done_before
    )


async def test_purge_needs_a_job_or_an_age(stack: Settings) -> None:
    code, _, err = await cli(stack, "purge")
    assert "--job ID, --older-than AGE" in one_error_line(code, err)
    code, _, err = await cli(stack, "purge", "--older-than", "a month")
    assert "30d" in one_error_line(code, err)
