"""A Postgres table as a job's output: one row per item, keyed by the item id.

A shard's rows are written in bulk and idempotently: COPY into a temporary staging
table, then one ``INSERT ... ON CONFLICT (item_id) DO UPDATE``, in one transaction.
A retry (the worker killed mid-write, or after the commit but before Temporal heard
of it), a re-run of the job or a dead-letter re-drive updates the same rows; no item
is ever in the table twice, and a write cut off leaves nothing (the transaction
rolls back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from llmbatch.contract.spec import JobSpec, Task
from llmbatch.contract.tables import TableUri, quote_ident
from llmbatch.tables.connect import TableError

STAGE_TABLE = "llmbatch_stage"


@dataclass(frozen=True)
class Column:
    """An output column: its type when llm-batch creates the table, the types an
    existing table may have instead, and its type in the staging table."""

    name: str
    create: str
    accepts: tuple[str, ...]
    stage: str


_TEXT = ("text", "character varying", "character")
_INT = ("integer", "bigint", "numeric")
_JSON = ("jsonb", "json")

ITEM_ID = Column("item_id", "text PRIMARY KEY", _TEXT, "text")
_COMMON = (
    ITEM_ID,
    Column("job_id", "text NOT NULL", _TEXT, "text"),
    Column("status", "text NOT NULL", _TEXT, "text"),
)
_TAIL = (
    Column("input", "jsonb", _JSON, "text"),
    Column("error_class", "text", _TEXT, "text"),
    Column("error", "jsonb", _JSON, "text"),
    Column(
        "updated_at",
        "timestamptz NOT NULL DEFAULT now()",
        ("timestamp with time zone",),
        "timestamptz",
    ),
)
GENERATE_COLUMNS = (
    *_COMMON,
    Column("text", "text", _TEXT, "text"),
    Column("parsed", "jsonb", _JSON, "text"),
    Column("finish_reason", "text", _TEXT, "text"),
    Column("prompt_tokens", "integer", _INT, "integer"),
    Column("completion_tokens", "integer", _INT, "integer"),
    Column("result_source", "text", _TEXT, "text"),
    Column("shared_with", "text", _TEXT, "text"),
    *_TAIL,
)
# Vectors: real[] (or pgvector's vector where the database has the extension).
_EMBEDDING = Column("embedding", "real[]", ("real[]", "double precision[]", "vector"), "real[]")
EMBED_COLUMNS = (
    *_COMMON,
    _EMBEDDING,
    Column("prompt_tokens", "integer", _INT, "integer"),
    *_TAIL,
)


def columns_for(spec: JobSpec) -> tuple[Column, ...]:
    return EMBED_COLUMNS if spec.task is Task.EMBED else GENERATE_COLUMNS


def _base_type(type_name: str) -> str:
    # "character varying(64)" -> "character varying", "vector(384)" -> "vector".
    return type_name.split("(", 1)[0].strip()


async def prepare_output(conn: asyncpg.Connection, table: TableUri, spec: JobSpec) -> bool:
    """Check an existing output table fits the job, or create it; True if created.

    Raises :class:`TableError` (one line) for an existing table it cannot upsert into:
    a missing column, a column of another type, no unique key on item_id, or a NOT
    NULL column of its own without a default."""
    columns = columns_for(spec)
    existing = await conn.fetch(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,"
        " a.atthasdef FROM pg_attribute a WHERE a.attrelid = to_regclass($1)"
        " AND a.attnum > 0 AND NOT a.attisdropped",
        table.qualified,
    )
    if not existing:
        await conn.execute(
            _create_sql(conn_has_vector=await _has_vector(conn), table=table, columns=columns)
        )
        return True
    have = {r["attname"]: r for r in existing}
    for column in columns:
        row = have.get(column.name)
        if row is None:
            raise TableError(
                f"output table {table.display} exists without column {column.name!r}; "
                "drop it, or name a new table"
            )
        if _base_type(row["type"]) not in column.accepts:
            raise TableError(
                f"output table {table.display}: column {column.name!r} is {row['type']}, "
                f"not {column.accepts[0]}"
            )
    ours = {c.name for c in columns}
    for name, row in have.items():
        if name not in ours and row["attnotnull"] and not row["atthasdef"]:
            raise TableError(
                f"output table {table.display}: its column {name!r} is NOT NULL without a "
                "default, and llm-batch does not fill it"
            )
    unique = await conn.fetchval(
        "SELECT count(*) FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
        " AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($1) AND i.indisunique"
        " AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = 'item_id'",
        table.qualified,
    )
    if not unique:
        raise TableError(
            f"output table {table.display}: item_id has no primary key or unique index, "
            "so results cannot be upserted by item id"
        )
    return False


async def _has_vector(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval("SELECT 1 FROM pg_extension WHERE extname = 'vector'"))


def _create_sql(*, conn_has_vector: bool, table: TableUri, columns: tuple[Column, ...]) -> str:
    defs = []
    for column in columns:
        kind = column.create
        if column is _EMBEDDING and conn_has_vector:
            kind = "vector"
        defs.append(f"{quote_ident(column.name)} {kind}")
    return f"CREATE TABLE IF NOT EXISTS {table.qualified} ({', '.join(defs)})"


async def upsert(
    conn: asyncpg.Connection, table: TableUri, spec: JobSpec, rows: list[dict[str, Any]]
) -> int:
    """Upsert ``rows`` (column name to value; ``input``, ``parsed`` and ``error`` as
    Python values) by item id, in one transaction; return how many."""
    columns = [c for c in columns_for(spec) if c.name != "updated_at"]
    names = [c.name for c in columns]
    quoted = ", ".join(quote_ident(n) for n in names)
    # One row per item (the last given): ON CONFLICT cannot touch a row twice.
    last = {row["item_id"]: row for row in rows}
    records = [tuple(_staged(c, row.get(c.name)) for c in columns) for row in last.values()]
    stage_defs = ", ".join(f"{quote_ident(c.name)} {c.stage}" for c in columns)
    # The staging table's text columns go to json/jsonb/vector by assignment casts.
    selected = ", ".join(
        f"{quote_ident(c.name)}::jsonb" if c.create == "jsonb" else quote_ident(c.name)
        for c in columns
    )
    updates = ", ".join(
        f"{quote_ident(n)} = EXCLUDED.{quote_ident(n)}" for n in names if n != ITEM_ID.name
    )
    async with conn.transaction():
        await conn.execute(f"CREATE TEMP TABLE {STAGE_TABLE} ({stage_defs}) ON COMMIT DROP")
        await conn.copy_records_to_table(STAGE_TABLE, records=records, columns=names)
        await conn.execute(
            f"INSERT INTO {table.qualified} ({quoted}) SELECT {selected} FROM {STAGE_TABLE}"
            f" ON CONFLICT ({quote_ident(ITEM_ID.name)}) DO UPDATE SET {updates},"
            " updated_at = now()"
        )
    return len(records)


def _staged(column: Column, value: Any) -> Any:
    if column.stage == "text" and column.create == "jsonb":
        return None if value is None else json.dumps(value)
    return value
