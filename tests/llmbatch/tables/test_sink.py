"""A table as output, on the stack's real Postgres (a database of its own)."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, Task
from llmbatch.contract.tables import parse_table_uri
from llmbatch.formats import planning
from llmbatch.tables import jobs, sink
from llmbatch.tables.connect import connect
from tests.fixtures.tables import TableDb


def job(db: TableDb, table: str = "labels", **values: object) -> JobSpec:
    base: dict[str, object] = {
        "job_id": "j",
        "inputs": ["s3://unused/in.jsonl"],
        "messages": [ChatMessage(role="user", content="{{ body }}")],
        "model": "m",
        "output_uri": db.uri(table),
    }
    return JobSpec(**{**base, **values})  # type: ignore[arg-type]


def result(item: str, text: str) -> dict[str, object]:
    return {
        "item_id": item,
        "job_id": "j",
        "status": "succeeded",
        "text": text,
        "parsed": {"label": text, "n": [1, 2]},
        "finish_reason": "stop",
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "result_source": "generated",
    }


async def test_created_then_upserted_idempotently(table_db: TableDb, stack: Settings) -> None:
    spec = job(table_db)
    await jobs.check_table_job(spec, stack, stack.render_limits, create_output=False)
    conn = await asyncpg.connect(table_db.dsn)
    # submit's check creates nothing; planning creates the table.
    assert await conn.fetchval("SELECT to_regclass('labels')") is None
    await jobs.check_table_job(spec, stack, stack.render_limits, create_output=True)
    table = parse_table_uri(spec.output_uri, output=True)
    rows = [result(f"tk-{n:06d}", "a") for n in range(10_000)]
    async with connect(table, stack) as out:
        assert await sink.upsert(out, table, spec, rows) == 10_000
        # A retry, a re-run, a re-drive: the same rows again, some with new results.
        assert await sink.upsert(out, table, spec, [*rows[:5000], result("tk-000001", "b")]) == 5000
    assert await conn.fetchval("SELECT count(*) FROM labels") == 10_000
    assert await conn.fetchval("SELECT count(DISTINCT item_id) FROM labels") == 10_000
    one = await conn.fetchrow("SELECT * FROM labels WHERE item_id = 'tk-000001'")
    assert one["text"] == "b" and one["prompt_tokens"] == 7 and one["status"] == "succeeded"
    # parsed output is jsonb: queryable as JSON in the database.
    assert (
        await conn.fetchval("SELECT parsed->>'label' FROM labels WHERE item_id = 'tk-000002'")
        == "a"
    )
    assert await conn.fetchval("SELECT jsonb_typeof(parsed) FROM labels LIMIT 1") == "object"
    # The existing table fits the next job: nothing to change.
    await jobs.check_table_job(spec, stack, stack.render_limits, create_output=True)
    await conn.close()


async def test_embeddings_to_real_array(table_db: TableDb, stack: Settings) -> None:
    spec = job(table_db, "vectors", task=Task.EMBED, messages=None, text="{{ body }}")
    await jobs.check_table_job(spec, stack, stack.render_limits, create_output=True)
    table = parse_table_uri(spec.output_uri, output=True)
    rows: list[dict[str, Any]] = [
        {
            "item_id": "a",
            "job_id": "j",
            "status": "succeeded",
            "embedding": [0.5, -1.0, 2.0],
            "prompt_tokens": 3,
        },
        {
            "item_id": "b",
            "job_id": "j",
            "status": "dead",
            "embedding": None,
            "error_class": "PromptTooLong",
            "error": {"message": "too long"},
        },
    ]
    async with connect(table, stack) as out:
        await sink.upsert(out, table, spec, rows)
    conn = await asyncpg.connect(table_db.dsn)
    got = {r["item_id"]: r for r in await conn.fetch("SELECT * FROM vectors")}
    kind = await conn.fetchval(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = 'vectors'::regclass AND attname = 'embedding'"
    )
    await conn.close()
    assert kind == "real[]"
    assert got["a"]["embedding"] == [0.5, -1.0, 2.0]
    assert got["b"]["embedding"] is None and got["b"]["error_class"] == "PromptTooLong"


@pytest.mark.parametrize(
    ("ddl", "says"),
    [
        ("CREATE TABLE labels (item_id text PRIMARY KEY, label text)", "without column 'job_id'"),
        (
            "CREATE TABLE labels (item_id integer PRIMARY KEY)",
            "column 'item_id' is integer, not text",
        ),
        ("CREATE TABLE labels (LIKE ok)", "no primary key or unique index"),
        ("CREATE TABLE labels (LIKE ok INCLUDING ALL, owner text NOT NULL)", "'owner' is NOT NULL"),
    ],
)
async def test_incompatible_table_is_refused_in_one_line(
    table_db: TableDb, stack: Settings, ddl: str, says: str
) -> None:
    spec = job(table_db)
    ok = job(table_db, "ok")
    await jobs.check_table_job(ok, stack, stack.render_limits, create_output=True)
    conn = await asyncpg.connect(table_db.dsn)
    await conn.execute(ddl)
    await conn.close()
    with pytest.raises(planning.InvalidJobSpec) as caught:
        await jobs.check_table_job(spec, stack, stack.render_limits, create_output=False)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)
