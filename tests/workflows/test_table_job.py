"""A job from a Postgres table to a Postgres table, end to end on the real stack
(Temporal dev server, the stack's Postgres in a database of the test's own, SeaweedFS
for the job's own objects, vLLM CPU with the tiny model)."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
import pytest
from temporalio.client import Client

from llmbatch import formats, storage
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from tests.fixtures.tables import TICKETS, TableDb, ticket_id

pytestmark = pytest.mark.slow

LABELS = ["billing", "bug", "other"]
LATE = 300


def label_job(db: TableDb, model: str, bucket: str, **values: object) -> JobSpec:
    base: dict[str, object] = {
        "job_id": f"tables-{uuid.uuid4().hex[:8]}",
        "inputs": [db.uri("tickets")],
        "messages": [
            ChatMessage(role="user", content="Label: {{ body }}, {{ price }}, {{ note }}")
        ],
        "model": model,
        "sampling": SamplingSpec(choice=LABELS, max_tokens=8),
        "output_uri": db.uri("ticket_labels"),
        "work_uri": f"s3://{bucket}/work",
        "shard_size": 2500,
        "max_concurrent_shards": 4,
    }
    return JobSpec(**{**base, **values})  # type: ignore[arg-type]


async def until_table(conn: asyncpg.Connection, name: str) -> None:
    for _ in range(1200):
        if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", name):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name} was not created")


async def test_table_to_table_every_row_once_and_late_rows_left_out(
    workers: Settings, temporal_client: Client, table_db: TableDb, model_name: str, bucket: str
) -> None:
    spec = label_job(table_db, model_name, bucket)
    conn = await asyncpg.connect(table_db.dsn)
    handle, started = await start_job(temporal_client, spec, settings=workers)
    assert started
    # The output table is created once the input's key ranges are planned: rows added
    # from then on, with keys past the largest one, are the next run's (the documented
    # snapshot rule), and a row changed before its shard is fetched is read changed.
    await until_table(conn, "ticket_labels")
    await conn.execute(
        "INSERT INTO tickets SELECT 'tk-' || lpad(g::text, 6, '0'), 'late ' || g, 1, NULL"
        " FROM generate_series($1::int, $2::int) g",
        TICKETS + 1,
        TICKETS + LATE,
    )
    summary = await asyncio.wait_for(handle.result(), 600)

    dead = await conn.fetch(
        "SELECT error_class, error->>'message' AS message FROM ticket_labels"
        " WHERE status = 'dead' LIMIT 3"
    )
    assert summary.state == "succeeded", [dict(r) for r in dead]
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (
        TICKETS,
        TICKETS,
        0,
    )
    rows = await conn.fetch("SELECT * FROM ticket_labels ORDER BY item_id")
    assert [r["item_id"] for r in rows] == [ticket_id(n) for n in range(1, TICKETS + 1)]
    assert all(r["text"] in LABELS and r["status"] == "succeeded" for r in rows)
    assert all(r["job_id"] == spec.job_id and r["error"] is None for r in rows)
    assert all(r["completion_tokens"] and r["finish_reason"] for r in rows)
    # The labels sit next to the tickets: one join, every ticket of the run labelled.
    joined = await conn.fetchval(
        "SELECT count(*) FROM tickets t JOIN ticket_labels l ON l.item_id = t.code"
    )
    assert joined == TICKETS
    # The job's own objects went to work_uri; the manifest names the table.
    store = storage.stores.open_store(summary.manifest, workers)
    manifest = json.loads(store.read_bytes(summary.manifest))
    assert summary.manifest.startswith(f"s3://{bucket}/work/{spec.job_id}/")
    assert manifest["output_table"] == spec.output_uri and manifest["output_parts"] == []

    # A re-run of the same rows under a new job id updates the rows, adds none.
    again = label_job(
        table_db,
        model_name,
        bucket,
        inputs=[
            table_db.query_uri(
                "SELECT code, body, price, note FROM tickets WHERE code <= 'tk-000100'"
            )
        ],
        id_field="code",
    )
    summary = await asyncio.wait_for(
        (await start_job(temporal_client, again, settings=workers))[0].result(), 600
    )
    assert summary.items_succeeded == 100
    assert await conn.fetchval("SELECT count(*) FROM ticket_labels") == TICKETS
    assert (
        await conn.fetchval("SELECT count(*) FROM ticket_labels WHERE job_id = $1", again.job_id)
        == 100
    )
    await conn.close()

    # A table in, files out: the rows' columns are the output's input fields.
    to_files = label_job(
        table_db,
        model_name,
        bucket,
        inputs=again.inputs,
        id_field="code",
        output_uri=f"s3://{bucket}/out",
        work_uri=None,
    )
    summary = await asyncio.wait_for(
        (await start_job(temporal_client, to_files, settings=workers))[0].result(), 600
    )
    assert summary.manifest.startswith(f"s3://{bucket}/out/{to_files.job_id}/")
    manifest = json.loads(store.read_bytes(summary.manifest))
    out = [
        row
        for part in manifest["output_parts"]
        for row in formats.read_jsonl_bytes(store.read_bytes(part))
    ]
    assert sorted(r["item_id"] for r in out) == [ticket_id(n) for n in range(1, 101)]
    third = next(r for r in out if r["item_id"] == ticket_id(3))
    assert third["input"] == {
        "code": ticket_id(3), "body": "ticket number 3", "price": "3.75", "note": None
    }  # fmt: skip
