"""An embed job from a Postgres query to a Postgres table, end to end: the vectors land
in a ``real[]`` column, one row per item (the embedding worker is a real process, the
tiny model run by vLLM's pooling runner)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import asyncpg
import pytest
from temporalio.client import Client

from llmbatch.client.temporal import start_job
from llmbatch.contract.spec import JobSpec, Task
from tests.fixtures.embed_worker import DIM, EmbedWorker
from tests.fixtures.tables import TableDb, ticket_id
from tests.fixtures.worker_processes import job_result

pytestmark = pytest.mark.slow

ROWS = 2000


async def test_embed_job_from_a_query_to_a_real_array_column(
    embed_worker: EmbedWorker, temporal_client: Client, table_db: TableDb, bucket: str
) -> None:
    spec = JobSpec(
        job_id=f"table-embed-{uuid.uuid4().hex[:8]}",
        task=Task.EMBED,
        inputs=[table_db.query_uri(f"SELECT * FROM tickets WHERE code <= '{ticket_id(ROWS)}'")],
        id_field="code",
        text="{{ body }} ({{ note }})",
        model=embed_worker.model,
        output_uri=table_db.uri("ticket_vectors"),
        output_fields=["body"],
        work_uri=f"s3://{bucket}/work",
        shard_size=500,
    )
    handle, _ = await start_job(temporal_client, spec, settings=embed_worker.settings)
    summary = await asyncio.wait_for(job_result(handle), 600)
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (ROWS, ROWS, 0)

    conn = await asyncpg.connect(table_db.dsn)
    rows = await conn.fetch("SELECT * FROM ticket_vectors ORDER BY item_id")
    kind = await conn.fetchval(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = 'ticket_vectors'::regclass AND attname = 'embedding'"
    )
    await conn.close()
    assert kind == "real[]"
    assert [r["item_id"] for r in rows] == [ticket_id(n) for n in range(1, ROWS + 1)]
    assert all(len(r["embedding"]) == DIM for r in rows)
    assert all(abs(math.hypot(*r["embedding"]) - 1.0) < 1e-3 for r in rows)
    # jsonb, as text on this plain connection.
    inputs = [json.loads(r["input"]) for r in rows]
    assert inputs == [{"body": f"ticket number {n}"} for n in range(1, ROWS + 1)]
    assert all(r["prompt_tokens"] and r["status"] == "succeeded" for r in rows)
