"""A Postgres table or read-only query as a job's input.

Shards are key ranges: planning reads the key of the id column that ends each shard
(one window query, on the server) and the largest key; shard ``i`` is the rows with
``bound[i-1] < key <= bound[i]``, read when the shard runs with keyset pagination
(``WHERE key > $1 AND key <= $2 ORDER BY key``) through a server-side cursor, so
neither planning nor a shard loads the table into the worker.

What a job sees (its snapshot rule): the rows whose key is at most the largest key
at planning; each shard reads its own range in one read-only REPEATABLE READ
transaction when it is fetched. A row added after planning with a larger key is not
part of the job (the next run's); a row added, changed or deleted inside a range
is seen as it is when that shard is fetched; a shard, once fetched, keeps the rows
it read through every later step and retry.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg

from llmbatch.contract.states import ErrorClass
from llmbatch.contract.tables import TableUri, quote_ident
from llmbatch.formats.readers import SourceRow
from llmbatch.formats.shards import ShardPlan, fold_remainder, shard_rows
from llmbatch.tables.connect import TableError

CURSOR_PREFETCH = 1000
# A key type as format_type() names it ("text", "character varying(20)", "uuid",
# "numeric(12,2)", "timestamp with time zone"): the only text spliced into SQL
# besides quoted identifiers and the caller's own read-only query.
_TYPE_NAME = re.compile(r'^[A-Za-z0-9_ ."(),\[\]]+$')


@dataclass(frozen=True)
class SourceInfo:
    """What planning learns of a table input."""

    fields: list[str]
    key: str
    key_type: str
    rows: int
    sample: dict[str, Any] | None


def source_sql(table: TableUri) -> str:
    """The FROM item of every read: the table, or the query as a subquery (so a
    statement that writes cannot even parse there)."""
    return table.qualified if table.query is None else f"({table.query}) AS src"


async def primary_key(conn: asyncpg.Connection, table: TableUri) -> str | None:
    """The table's one-column primary key, if it has one."""
    rows = await conn.fetch(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
        " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
        " WHERE i.indrelid = to_regclass($1) AND i.indisprimary",
        table.qualified,
    )
    return rows[0]["attname"] if len(rows) == 1 else None


async def inspect_source(
    conn: asyncpg.Connection, table: TableUri, *, id_field: str | None
) -> SourceInfo:
    """Fields, key column and type, row count and the first row, in one read-only
    transaction. Raises :class:`TableError` for what no retry cures (no such table,
    a query that writes, no usable key, NULL keys)."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        if table.query is None:
            exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table.qualified)
            if not exists:
                raise TableError(f"{table.display}: no such table")
        statement = await conn.prepare(f"SELECT * FROM {source_sql(table)} LIMIT 0")
        attributes = statement.get_attributes()
        fields = [a.name for a in attributes]
        key = id_field
        if key is None:
            key = await primary_key(conn, table)
            if key is None:
                raise TableError(f"{table.display} has no one-column primary key: give id_field")
        by_name = {a.name: a for a in attributes}
        if key not in by_name:
            raise TableError(f"id field {key!r} is not a column of {table.display}")
        key_type = await conn.fetchval("SELECT format_type($1::oid, NULL)", by_name[key].type.oid)
        if not _TYPE_NAME.match(key_type):
            raise TableError(f"{table.display}: id column type {key_type!r} cannot key shards")
        k = f"src.{quote_ident(key)}"
        counts = await conn.fetchrow(
            f"SELECT count(*) AS rows, count(*) FILTER (WHERE {k} IS NULL) AS nulls"
            f" FROM {_from(table)}"
        )
        if counts["nulls"]:
            raise TableError(
                f"{table.display}: {counts['nulls']} rows have a NULL {key}; an item needs an id"
            )
        first = await conn.fetchrow(f"SELECT * FROM {_from(table)} ORDER BY {k} LIMIT 1")
    sample = None if first is None else {n: jsonable(v) for n, v in first.items()}
    return SourceInfo(fields=fields, key=key, key_type=key_type, rows=counts["rows"], sample=sample)


def _from(table: TableUri) -> str:
    # A table gets the alias "src" too, so every statement names the key alike.
    return f"{table.qualified} AS src" if table.query is None else source_sql(table)


async def plan_key_ranges(
    conn: asyncpg.Connection, table: TableUri, info: SourceInfo, *, shard_size: int | None
) -> list[ShardPlan]:
    """Shards of :func:`llmbatch.formats.shards.shard_rows` rows as key ranges, planned
    on the server: the row numbers that end a shard are those of the growing first
    shards, then every ``steady``-th after them (and the last folded, as a file's is)."""
    ends, steady = _shard_ends(shard_size)
    k = f"src.{quote_ident(info.key)}"
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await conn.fetch(
            f"SELECT b::text AS bound, n FROM (SELECT {k} AS b, row_number() OVER"
            f" (ORDER BY {k}) AS n, count(*) OVER () AS total FROM {_from(table)}) s"
            " WHERE n = ANY($1::bigint[]) OR (n > $2 AND (n - $2) % $3 = 0) OR n = total"
            " ORDER BY n",
            ends,
            ends[-1] if ends else 0,
            steady,
        )
    plans: list[ShardPlan] = []
    after: str | None = None
    done = 0
    for row in rows:
        if row["bound"] == after:
            continue  # repeated keys at a boundary: their rows are in the range before
        plans.append(
            ShardPlan(
                index=len(plans),
                uri=table.uri,
                first_row=done,
                row_count=row["n"] - done,
                key_after=after,
                key_upto=row["bound"],
                key_type=info.key_type,
                id_field=info.key,
            )
        )
        after, done = row["bound"], row["n"]
    return fold_remainder(plans, shard_size=shard_size, first_index=0)


def _shard_ends(shard_size: int | None) -> tuple[list[int], int]:
    """(the row numbers ending the shards before sizes stop changing, the size from
    then on)."""
    ends: list[int] = []
    index, done = 0, 0
    while (size := shard_rows(shard_size, index)) != shard_rows(shard_size, index + 1):
        done += size
        ends.append(done)
        index += 1
    return ends, size


async def read_shard(
    conn: asyncpg.Connection, table: TableUri, plan: ShardPlan, *, max_row_bytes: int
) -> AsyncIterator[SourceRow]:
    """The shard's rows in key order, streamed through a server-side cursor inside one
    read-only REPEATABLE READ transaction (one snapshot per shard). A row over
    ``max_row_bytes`` as JSON comes back as a ``RowTooLarge`` error, as in a file."""
    if plan.id_field is None or plan.key_type is None or plan.key_upto is None:
        raise TableError(f"shard {plan.index} of {table.display} has no key range")
    if not _TYPE_NAME.match(plan.key_type):
        raise TableError(f"shard {plan.index}: key type {plan.key_type!r} is not a type name")
    k = f"src.{quote_ident(plan.id_field)}"
    cast = f"::text::{plan.key_type}"
    where = f"{k} <= $1{cast}"
    args: list[str] = [plan.key_upto]
    if plan.key_after is not None:
        where += f" AND {k} > $2{cast}"
        args.append(plan.key_after)
    sql = f"SELECT * FROM {_from(table)} WHERE {where} ORDER BY {k}"
    ordinal = plan.first_row
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        async for record in conn.cursor(sql, *args, prefetch=CURSOR_PREFETCH):
            try:
                fields = {n: jsonable(v) for n, v in record.items()}
            except (TypeError, ValueError) as exc:
                yield SourceRow(
                    ordinal,
                    f"{table.display} {plan.id_field}={record[plan.id_field]}",
                    None,
                    error=f"cannot read the row: {exc}",
                    error_class=ErrorClass.INVALID_ROW,
                )
            else:
                source = f"{table.display} {plan.id_field}={fields[plan.id_field]}"
                size = len(json.dumps(fields, ensure_ascii=False).encode())
                if size > max_row_bytes:
                    yield SourceRow(
                        ordinal,
                        source,
                        None,
                        error=f"the row is {size} bytes as JSON, over {max_row_bytes}",
                        error_class=ErrorClass.ROW_TOO_LARGE,
                    )
                else:
                    yield SourceRow(ordinal, source, fields)
            ordinal += 1


def jsonable(value: Any) -> Any:
    """A column value as JSON, for templates and the staged rows: numeric as its exact
    decimal text, times as ISO 8601, bytes as base64, json/jsonb parsed."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, asyncpg.Record):
        return {k: jsonable(v) for k, v in value.items()}
    # Ranges, network addresses, geometric types: their text form.
    return str(value)
