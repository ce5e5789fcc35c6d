"""The ledger's connection to Postgres: the pool (jsonb as Python objects), the
``Database`` every ledger function takes, and a transaction that nests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import asyncpg
import msgspec

from llmbatch.contract.states import (
    TERMINAL_STATUSES,
)

# Bound as a text[] parameter wherever SQL asks "finished?".
TERMINAL = [str(s) for s in TERMINAL_STATUSES]


# Every function takes a pool, or a connection when the caller wants several calls
# in one transaction of its own.
Database: TypeAlias = asyncpg.Pool | asyncpg.Connection


@asynccontextmanager
async def transaction(db: Database) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            yield conn
    else:
        async with db.transaction():  # a savepoint inside the caller's transaction
            yield db


# How a statement over a batch of one job's items names them, so that its plan reads
# each item by its key, however stale Postgres's statistics are. A job's id is new
# to them until autoanalyze has seen it, which on a large ledger is never (a job of
# less than a tenth of the table), and the values a running job's items hold
# (``pending``, ``running``, a lease owner) are rare or absent in them. Compared with
# those values, the job's items look like one row, and the planner put them outside
# a loop over the batch: 9,000 items answered from their leads by 81 million
# comparisons (26 s of Postgres), a batch of 256 results checked against every item
# the shard held. tests/llmbatch/ledger/test_new_job_plans.py runs the ledger's
# statements on such statistics.
#
# THIS_JOB is the job id ($1) behind a subquery: the planner weighs it as an average
# job, and still looks items up by it in the index.
THIS_JOB = "(SELECT $1::text)"


def batch_rows(arrays: str, columns: str, *, carried: str) -> str:
    """The batch as a relation: ``unnest(arrays) AS (columns)``, with the other
    values the statement compares items with (``carried``, such as
    ``"$2::text AS lease_owner"``) as columns of its own, behind ``OFFSET 0`` so that
    the planner cannot see them as constants. Compared with these columns, a rare
    status or an unseen lease owner is checked on each item found by its key,
    instead of making the job's items look like one row."""
    return f"(SELECT u.*, {carried} FROM unnest({arrays}) AS u({columns}) OFFSET 0)"


_decode = msgspec.json.Decoder().decode


def _decode_jsonb(text: str) -> Any:
    # In C (the results a shard's write step reads are most of what it decodes); a
    # number past a float's range takes json's path, which reads it as infinity.
    try:
        return _decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=_decode_jsonb, schema="pg_catalog"
    )


async def create_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    connect_timeout_s: float = 60.0,
    command_timeout_s: float | None = None,
) -> asyncpg.Pool:
    """A pool whose connections read and write jsonb as Python objects. The timeouts
    bound a connection attempt and a statement (None: none), for callers that must
    answer promptly when the database is away (the HTTP API)."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        init=_init_connection,
        timeout=connect_timeout_s,
        command_timeout=command_timeout_s,
    )
    assert pool is not None
    return pool
