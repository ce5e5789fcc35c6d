"""``llm-batch submit`` with table URIs, as a real process against the session's stack:
its refusals are one line, before anything is scheduled, and its help names both forms."""

from __future__ import annotations

import asyncpg
import pytest

from llmbatch.config import Settings
from tests.fixtures.tables import TableDb
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow


async def submit(settings: Settings, *args: str) -> tuple[int, str]:
    code, _, err = await cli(settings, "submit", "--model", "m", "--user", "{{ body }}", *args)
    return code, err.strip()


async def test_table_refusals_are_one_line(table_db: TableDb, stack: Settings) -> None:
    tickets, labels = table_db.uri("tickets"), table_db.uri("labels")
    secret = tickets.replace("postgres@", "postgres:hunter2@")
    code, err = await submit(stack, "--input", secret, "--output", labels)
    assert code == 1 and "carries a password" in err and "hunter2" not in err
    assert len(err.splitlines()) == 1

    conn = await asyncpg.connect(table_db.dsn)
    await conn.execute("CREATE TABLE labels (item_id bigint PRIMARY KEY, label text)")
    await conn.execute("CREATE SEQUENCE s")
    await conn.close()
    code, err = await submit(stack, "--input", tickets, "--output", labels)
    assert code == 1 and "column 'item_id' is bigint, not text" in err
    assert len(err.splitlines()) == 1

    writes = table_db.query_uri("SELECT code, body, nextval('s') FROM tickets")
    code, err = await submit(stack, "--input", writes, "--id-field", "code")
    assert code == 1 and "cannot execute nextval() in a read-only transaction" in err
    assert len(err.splitlines()) == 1

    code, err = await submit(stack, "--input", table_db.query_uri("DELETE FROM tickets"))
    assert code == 1 and "not read-only" in err and len(err.splitlines()) == 1


async def test_help_and_schema_name_both_uri_forms(stack: Settings) -> None:
    _, out, _ = await cli(stack, "submit", "--help")
    assert "?table=" in out and "?query=" in out
    _, schema, _ = await cli(stack, "schema")
    assert "?table=" in schema and "?query=" in schema
