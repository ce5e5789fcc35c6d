"""The ledger's connection to Postgres: the pool (jsonb as Python objects), the
``Database`` every ledger function takes, and a transaction that nests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeAlias

import asyncpg

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


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections read and write jsonb as Python objects."""
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection
    )
    assert pool is not None
    return pool
