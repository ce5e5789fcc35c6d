"""Connecting to a table URI's database, and telling transient database errors from
permanent ones.

asyncpg, not ADBC (see docs/guides/tables.md): activities are async, and asyncpg's
errors carry the server's SQLSTATE, which is what the retry policy needs here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from llmbatch.config import Settings
from llmbatch.contract import tables as table_uris
from llmbatch.contract.tables import TableUri
from llmbatch.errors import LlmBatchError

# SQLSTATE classes worth a retry: connection exceptions (08), transaction rollbacks
# such as serialization failures and deadlocks (40), insufficient resources (53),
# operator intervention such as a shutdown or a cancelled statement (57), system
# errors (58). Anything else (a missing table, a type mismatch, a read-only
# violation, a refused login) gives the same answer every time.
TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
CONNECT_TIMEOUT_S = 30.0
APPLICATION_NAME = "llm-batch"


class TableError(LlmBatchError):
    """A database error that retrying will not cure; the message is one line."""


def is_transient(exc: BaseException) -> bool:
    """Whether retrying after ``exc`` may succeed."""
    if isinstance(exc, asyncpg.PostgresError):
        state = exc.sqlstate or ""
        return state[:2] in TRANSIENT_SQLSTATE_CLASSES
    # The network, a timeout, a server that went away mid-statement.
    return isinstance(exc, OSError | TimeoutError | asyncpg.InterfaceError)


def as_table_error(exc: BaseException, table: TableUri) -> TableError:
    """A permanent database error as a one-line :class:`TableError`."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return TableError(f"{table.display}: {message}")


# What a database call raises: the server's errors, the driver's, the network's.
DATABASE_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)


def check_allowed(table: TableUri, settings: Settings) -> None:
    """Refuse a table (or a query's database) outside the workers' ``allowed_tables``."""
    if not table_uris.allowed(table, settings.allowed_table_patterns):
        raise TableError(
            f"{table.resource} is outside the tables this worker may use (LLMBATCH_ALLOWED_TABLES)"
        )


@asynccontextmanager
async def connect(table: TableUri, settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """A connection to ``table``'s database, after the allowed-tables check. The
    password comes from the environment (PGPASSWORD, PGPASSFILE or ~/.pgpass), as
    libpq has it; permanent errors come out as :class:`TableError`."""
    check_allowed(table, settings)
    try:
        conn = await asyncpg.connect(
            table.dsn,
            timeout=CONNECT_TIMEOUT_S,
            server_settings={"application_name": APPLICATION_NAME},
        )
    except DATABASE_ERRORS as exc:
        if is_transient(exc):
            raise  # itself, not a copy with itself as cause: Temporal retries it
        raise as_table_error(exc, table) from exc
    try:
        # json and jsonb as Python values both ways: rows for templates, parsed output.
        for name in ("json", "jsonb"):
            await conn.set_type_codec(
                name, encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
            )
        yield conn
    except DATABASE_ERRORS as exc:
        if is_transient(exc):
            raise
        raise as_table_error(exc, table) from exc
    finally:
        # terminate(), not close(): a connection a failed statement broke cannot be
        # closed politely, and nothing is left to flush.
        conn.terminate()
