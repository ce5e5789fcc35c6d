"""Rows/s reading a job's input from a Postgres table and writing its output to a
table, against reading and writing the same rows as CSV in the object store.

One run on one machine, on an embedded stack of its own (Postgres and the S3 server).
Both sides do what a job does per shard, through llm-batch's own code, without the
engine: reading plans shards (key ranges of the table; record-aligned byte ranges of
the CSV object) and reads every shard into rows; writing puts one output row per
item, by shards: the table's upsert (COPY into a staging table, then one INSERT ...
ON CONFLICT) against one CSV part per shard put to the object store.

    .venv/bin/python benchmarks/tables_vs_csv.py --rows 100000 --shard-size 1000
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
from peer import finished

from llmbatch import formats, storage
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec
from llmbatch.contract.tables import parse_table_uri
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.tables import jobs, sink
from llmbatch.tables.connect import connect

DATABASE = "bench_tables"


def table_uri(settings: Settings, table: str) -> str:
    return f"postgresql://postgres@127.0.0.1:{settings.postgres_port}/{DATABASE}?table={table}"


async def make_table(settings: Settings, rows: int) -> list[dict[str, Any]]:
    admin = await asyncpg.connect(settings.postgres_dsn.get_secret_value())
    await admin.execute(f"CREATE DATABASE {DATABASE}")
    await admin.close()
    dsn = settings.postgres_dsn.get_secret_value().rsplit("/", 1)[0] + f"/{DATABASE}"
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "CREATE TABLE tickets (code text PRIMARY KEY, body text NOT NULL,"
        " price numeric(10, 2), note text)"
    )
    await conn.execute(
        "INSERT INTO tickets SELECT 'tk-' || lpad(g::text, 8, '0'),"
        " 'ticket number ' || g || ': ' || repeat('the printer is on fire ', 4),"
        " g * 1.25, CASE WHEN g % 3 = 0 THEN NULL ELSE 'note ' || g END"
        " FROM generate_series(1, $1::int) g",
        rows,
    )
    records = await conn.fetch("SELECT code, body, price::text AS price, note FROM tickets")
    await conn.close()
    return [dict(r) for r in records]


def spec(settings: Settings, *, inputs: list[str], output_uri: str, shard_size: int) -> JobSpec:
    return JobSpec(
        job_id="bench",
        inputs=inputs,
        messages=[ChatMessage(role="user", content="{{ body }}")],
        model="m",
        shard_size=shard_size,
        output_uri=output_uri,
        id_field="code",
    )


async def read_table(settings: Settings, shard_size: int) -> tuple[int, float]:
    job = spec(
        settings,
        inputs=[table_uri(settings, "tickets")],
        output_uri=f"s3://{settings.s3_bucket}/out",
        shard_size=shard_size,
    )
    started = time.perf_counter()
    shards = await jobs.check_table_job(job, settings, settings.render_limits, create_output=True)
    rows = 0
    for shard in shards or []:
        rows += len(await jobs.read_shard(shard, settings, max_row_bytes=1 << 20))
    return rows, time.perf_counter() - started


def read_csv(settings: Settings, uri: str, shard_size: int) -> tuple[int, float]:
    stores = storage.stores.Stores(settings)
    started = time.perf_counter()
    objects = stores(uri).list(uri)
    shards = formats.plan_shards(stores, objects, InputFormat.CSV, shard_size=shard_size)
    rows = 0
    for shard in shards:
        rows += sum(1 for _ in formats.read_shard(stores(shard.uri), shard, InputFormat.CSV))
    return rows, time.perf_counter() - started


def results(source: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "item_id": r["code"],
            "job_id": "bench",
            "status": "succeeded",
            "text": "billing",
            "parsed": {"label": "billing"},
            "finish_reason": "stop",
            "prompt_tokens": 40,
            "completion_tokens": 2,
            "result_source": "generated",
        }
        for r in source
    ]


async def write_table(settings: Settings, out: list[dict[str, Any]], shard_size: int) -> float:
    job = spec(
        settings,
        inputs=[table_uri(settings, "tickets")],
        output_uri=table_uri(settings, "labels"),
        shard_size=shard_size,
    )
    await jobs.check_table_job(job, settings, settings.render_limits, create_output=True)
    table = parse_table_uri(job.output_uri, output=True)
    started = time.perf_counter()
    for start in range(0, len(out), shard_size):
        # A connection per shard, as write_shard opens one per call.
        async with connect(table, settings) as conn:
            await sink.upsert(conn, table, job, out[start : start + shard_size])
    return time.perf_counter() - started


def write_csv(settings: Settings, out: list[dict[str, Any]], shard_size: int) -> float:
    stores = storage.stores.Stores(settings)
    started = time.perf_counter()
    for n, start in enumerate(range(0, len(out), shard_size)):
        uri = f"s3://{settings.s3_bucket}/bench/out/part-{n:05d}.csv"
        stores(uri).put_bytes(uri, csv_bytes(out[start : start + shard_size]))
    return time.perf_counter() - started


def csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    """``rows`` as CSV with a header (nested values as their JSON text)."""
    flat = [{k: json.dumps(v) if isinstance(v, dict) else v for k, v in r.items()} for r in rows]
    buffer = io.StringIO()
    out = csv.writer(buffer, lineterminator="\n")
    out.writerow(list(flat[0]))
    out.writerows(list(r.values()) for r in flat)
    return buffer.getvalue().encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--shard-size", type=int, default=1000)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmbatch-tables-bench-"))
    settings = isolated_settings(work / "stack")
    settings = settings.model_copy(
        update={"allowed_tables": f"127.0.0.1:{settings.postgres_port}/{DATABASE}/*"}
    )
    dev = DevStack(settings)
    dev.up()
    try:
        source = asyncio.run(make_table(settings, args.rows))
        csv_uri = f"s3://{settings.s3_bucket}/bench/tickets.csv"
        storage.stores.open_store(csv_uri, settings).put_bytes(csv_uri, csv_bytes(source))
        out = results(source)
        table_rows, table_read_s = asyncio.run(read_table(settings, args.shard_size))
        csv_rows, csv_read_s = read_csv(settings, csv_uri, args.shard_size)
        assert table_rows == csv_rows == args.rows, (table_rows, csv_rows)
        table_write_s = asyncio.run(write_table(settings, out, args.shard_size))
        csv_write_s = write_csv(settings, out, args.shard_size)
    finally:
        dev.down()

    n = args.rows
    print(f"\n{n} rows, shards of {args.shard_size}, one run:")
    print(f"  read  Postgres table  {n / table_read_s:10,.0f} rows/s  ({table_read_s:.2f} s)")
    print(f"  read  CSV in S3       {n / csv_read_s:10,.0f} rows/s  ({csv_read_s:.2f} s)")
    print(f"  write Postgres table  {n / table_write_s:10,.0f} rows/s  ({table_write_s:.2f} s)")
    print(f"  write CSV parts to S3 {n / csv_write_s:10,.0f} rows/s  ({csv_write_s:.2f} s)")

    finished(work)


if __name__ == "__main__":
    main()
