"""SIGKILL the CPU worker while it writes the output table: every item is in the table
exactly once afterwards.

Real processes: the CPU worker runs as ``llm-batch worker cpu`` on a task queue of its
own; generation runs on the session's in-process GPU worker. The test holds a SHARE
lock on the output table, so the worker's upsert (COPY into its staging table, then
INSERT ... ON CONFLICT) waits inside its transaction; the worker is SIGKILLed while
Postgres shows its INSERT waiting, the lock is let go, and a second worker takes over.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import asyncpg
import pytest
from temporalio.client import Client

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from llmbatch.tables import jobs
from llmbatch.tables.connect import APPLICATION_NAME
from tests.fixtures.tables import TICKETS, TableDb, ticket_id
from tests.fixtures.worker_processes import (
    cpu_worker_process,
    job_result,
    signal_group,
    stop_worker,
)

pytestmark = pytest.mark.slow


async def until_insert_waits(conn: asyncpg.Connection, within_s: float = 300) -> int:
    """The number of llm-batch upserts waiting on the test's lock, once there is one."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
            " AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%'",
            APPLICATION_NAME,
        )
        if waiting:
            return int(waiting)
        await asyncio.sleep(0.1)
    raise TimeoutError("no upsert waited on the output table")


async def test_cpu_worker_killed_writing_the_table_every_item_once(
    workers: Settings,
    temporal_client: Client,
    table_db: TableDb,
    model_name: str,
    bucket: str,
    tmp_path: Path,
) -> None:
    own = workers.model_copy(update={"cpu_task_queue": f"cpu-table-{uuid.uuid4().hex[:8]}"})
    spec = JobSpec(
        job_id=f"table-kill-{uuid.uuid4().hex[:8]}",
        inputs=[table_db.uri("tickets")],
        messages=[ChatMessage(role="user", content="{{ body }} {{ price }} {{ note }}")],
        model=model_name,
        sampling=SamplingSpec(max_tokens=4, temperature=1.0),
        shard_size=2500,
        max_concurrent_shards=4,
        output_uri=table_db.uri("ticket_labels"),
        work_uri=f"s3://{bucket}/work",
    )
    # The output table exists before the job (as planning would create it), so the
    # test can lock it before any write.
    await jobs.check_table_job(spec, own, own.render_limits, create_output=True)
    watcher = await asyncpg.connect(table_db.dsn)
    locker = await asyncpg.connect(table_db.dsn)
    lock = locker.transaction()
    await lock.start()
    await locker.execute("LOCK TABLE ticket_labels IN SHARE MODE")
    procs = [cpu_worker_process(own, tmp_path / f"cpu-{n}.log") for n in range(2)]
    first, second = procs
    try:
        signal_group(second, signal.SIGSTOP)
        await wait_for_pollers(temporal_client, [own.cpu_task_queue], procs=[first], within_s=120)
        handle, _ = await start_job(temporal_client, spec, settings=own)

        waiting = await until_insert_waits(watcher)
        signal_group(first, signal.SIGKILL)
        await asyncio.to_thread(first.wait, 30)
        await lock.rollback()  # let go: the dead worker's transactions can only roll back
        assert waiting >= 1
        assert await watcher.fetchval("SELECT count(*) FROM ticket_labels") == 0
        signal_group(second, signal.SIGCONT)

        summary = await asyncio.wait_for(job_result(handle), 600)
    finally:
        for proc in procs:
            stop_worker(proc)
        await locker.close()

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (
        TICKETS,
        TICKETS,
        0,
    )
    rows = await watcher.fetch("SELECT item_id, status, job_id FROM ticket_labels ORDER BY item_id")
    await watcher.close()
    assert [r["item_id"] for r in rows] == [ticket_id(n) for n in range(1, TICKETS + 1)]
    assert {(r["status"], r["job_id"]) for r in rows} == {("succeeded", spec.job_id)}
