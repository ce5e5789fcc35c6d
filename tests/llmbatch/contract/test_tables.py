"""Table URIs and the job spec's refusals for them (no database needed)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec
from llmbatch.contract.tables import TableUriError, allowed, is_table_uri, parse_table_uri

HOST = "postgresql://app@db.internal:6543/shop"


def spec(**values: Any) -> JobSpec:
    base: dict[str, Any] = {
        "job_id": "j",
        "inputs": [f"{HOST}?table=tickets"],
        "messages": [ChatMessage(role="user", content="{{ body }}")],
        "model": "m",
        "output_uri": f"{HOST}?table=labels",
    }
    return JobSpec(**{**base, **values})


def test_table_uri_parts() -> None:
    table = parse_table_uri(f"{HOST}?table=Sales.%22Open%20Tickets%22")
    assert (table.host, table.port, table.database, table.user) == (
        "db.internal",
        6543,
        "shop",
        "app",
    )
    assert table.table == ("sales", "Open Tickets")
    assert table.qualified == '"sales"."Open Tickets"'
    assert table.dsn == "postgresql://app@db.internal:6543/shop"
    assert table.resource == "db.internal:6543/shop/sales.Open Tickets"
    assert parse_table_uri("postgres://h/db?table=t").table == ("public", "t")
    assert parse_table_uri("postgres://h/db?table=t").port == 5432
    assert is_table_uri("PostgreSQL://h/db?table=t") and not is_table_uri("s3://b/k")


def test_query_uri_is_the_query() -> None:
    table = parse_table_uri(f"{HOST}?query=SELECT%20id%2C%20body%20FROM%20t%20WHERE%20x%20%3D%201;")
    assert table.table is None
    assert table.query == "SELECT id, body FROM t WHERE x = 1"
    assert table.resource == "db.internal:6543/shop/*"


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("postgresql://app:hunter2@h/db?table=t", "carries a password"),
        ("postgresql://h/db", "needs one of ?table= or ?query="),
        ("postgresql://h/db?table=t&query=SELECT%201", "needs one of"),
        ("postgresql://h/db?table=t&user=x", "unknown parameter(s) user"),
        ("postgresql://h/?table=t", "must name one database"),
        ("postgresql://h/db?table=a.b.c", "is not a table name"),
        ("postgresql://h/db?query=DELETE%20FROM%20t", "not read-only"),
        ("postgresql://h/db?query=SELECT%201;%20DROP%20TABLE%20t", "not read-only"),
    ],
)
def test_refused_uris(uri: str, says: str) -> None:
    with pytest.raises(TableUriError, match=None) as caught:
        parse_table_uri(uri)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_allowed_patterns() -> None:
    table = parse_table_uri(f"{HOST}?table=tickets")
    query = parse_table_uri(f"{HOST}?query=SELECT%201")
    assert allowed(table, ["db.internal:6543/shop/public.*"])
    assert not allowed(table, ["db.internal:6543/shop/public.users"])
    assert not allowed(table, [])
    # A query may read any table of its database: only a whole-database grant allows it.
    assert not allowed(query, ["db.internal:6543/shop/public.*"])
    assert allowed(query, ["db.internal:6543/shop/*"])


def test_spec_takes_table_in_and_out() -> None:
    job = spec()
    assert job.table_input and job.table_output
    assert spec(output_uri="s3://b/out").table_output is False


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"inputs": [f"{HOST}?table=a", f"{HOST}?table=b"]}, "only input"),
        ({"inputs": [f"{HOST}?query=SELECT%20*%20FROM%20t"]}, "needs id_field"),
        ({"output_uri": f"{HOST}?query=SELECT%201"}, "must name a table"),
        ({"output_uri": "postgresql://u:pw@h/db?table=t"}, "carries a password"),
        ({"input_format": InputFormat.CSV}, "drop 'input_format'"),
        ({"inputs": ["s3://b/k.jsonl"], "input_format": InputFormat.TABLE}, "needs a postgresql"),
        ({"work_uri": "ftp://x/y"}, "work_uri must be"),
    ],
)
def test_spec_refusals(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        spec(**values)
    assert says in str(caught.value)
