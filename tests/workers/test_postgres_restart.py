"""Restart Postgres in the middle of a job: activities retry and every item ends once.

The restart is the real thing: the session stack's Postgres is stopped the way its
supervisor would (``pg_ctl stop -m fast``, which ends every session), stays down for
a few seconds, and is started again from the same data folder. The session's
workers keep running through it; their connection pools must find the new server.
The stack is brought back up however the test ends, for the tests that follow.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack import DevStack
from llmbatch.devstack.parts import PostgresPart
from tests.fixtures.worker_processes import items_by_id, job_result, until_done

pytestmark = pytest.mark.slow

ROWS, SHARD = 1500, 250
DOWN_FOR_S = 5.0


async def test_postgres_restart_mid_job_every_item_once(
    workers: Settings, temporal_client: Client, model_name: str, tmp_path: Path
) -> None:
    stack = workers
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)))
    spec = JobSpec(
        job_id=f"pg-restart-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model_name,
        sampling=SamplingSpec(max_tokens=16),
        shard_size=SHARD,
        max_concurrent_shards=2,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    dsn = stack.postgres_dsn.get_secret_value()
    handle, _ = await start_job(temporal_client, spec, settings=stack)
    pool = await ledger.db.create_pool(dsn)
    try:
        await until_done(pool, spec.job_id, ROWS // 4, in_flight=True)
    finally:
        await pool.close()  # its connections die with the server anyway
    try:
        # Blocking calls: off the event loop, which drives the session's workers.
        stopped_at = time.monotonic()
        await asyncio.to_thread(PostgresPart(stack).stop)
        await asyncio.sleep(DOWN_FOR_S)
        await asyncio.to_thread(DevStack(stack).up)
        up_at = time.monotonic()
        summary = await asyncio.wait_for(job_result(handle), 600)
        finished_at = time.monotonic()
    finally:
        # Whatever happened, the next tests get a running Postgres.
        await asyncio.to_thread(DevStack(stack).up)
    pool = await ledger.db.create_pool(dsn)
    try:
        rows = await items_by_id(pool, spec.job_id)
    finally:
        await pool.close()

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (ROWS, ROWS, 0)
    assert len(rows) == ROWS and {r["status"] for r in rows.values()} == {"succeeded"}
    out_ids = [
        json.loads(line)["item_id"]
        for part in sorted((tmp_path / "out" / spec.job_id).glob("part-*.jsonl"))
        for line in part.read_text().split("\n")[:-1]
    ]
    assert len(out_ids) == ROWS and set(out_ids) == set(rows)
    regenerated = sum(1 for r in rows.values() if r["attempt"] > 1)
    # At most the shards that were running when the database went away start over.
    assert regenerated <= 2 * SHARD
    print(
        f"\nPostgres down {up_at - stopped_at:.1f} s; job finished "
        f"{finished_at - stopped_at:.1f} s after the stop; {regenerated} items generated again"
    )
