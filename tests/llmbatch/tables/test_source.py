"""A table or query as input, on the stack's real Postgres (a database of its own)."""

from __future__ import annotations

import asyncpg
import pytest

from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec
from llmbatch.contract.tables import parse_table_uri
from llmbatch.formats import planning
from llmbatch.tables import jobs, source
from llmbatch.tables.connect import TableError, connect, is_transient
from tests.fixtures.tables import TICKETS, TableDb, ticket_id

MAX = 1 << 20


def job(db: TableDb, **values: object) -> JobSpec:
    base: dict[str, object] = {
        "job_id": "j",
        "inputs": [db.uri("tickets")],
        "messages": [ChatMessage(role="user", content="{{ body }} costs {{ price }} ({{ note }})")],
        "model": "m",
        "output_uri": "s3://unused/out",
        "shard_size": 3000,
    }
    return JobSpec(**{**base, **values})  # type: ignore[arg-type]


async def test_key_ranges_cover_every_row_once(table_db: TableDb, stack: Settings) -> None:
    spec = job(table_db)
    shards = await jobs.check_table_job(spec, stack, stack.render_limits, create_output=True)
    assert shards is not None
    assert [(s.key_after, s.key_upto, s.row_count, s.first_row) for s in shards] == [
        (None, ticket_id(3000), 3000, 0),
        (ticket_id(3000), ticket_id(6000), 3000, 3000),
        (ticket_id(6000), ticket_id(9000), 3000, 6000),
        (ticket_id(9000), ticket_id(TICKETS), 1000, 9000),
    ]
    assert {s.id_field for s in shards} == {"code"}  # the primary key, not given
    read = [await jobs.read_shard(s, stack, max_row_bytes=MAX) for s in shards]
    ids = [r.fields["code"] for rows in read for r in rows if r.fields is not None]
    assert ids == [ticket_id(n) for n in range(1, TICKETS + 1)]
    assert [r.ordinal for rows in read for r in rows] == list(range(TICKETS))
    third, first = read[0][2].fields, read[0][0].fields
    # numeric exactly as text, NULL as None.
    assert first == {
        "code": ticket_id(1),
        "body": "ticket number 1",
        "price": "1.25",
        "note": "note 1",
    }
    assert third is not None and third["note"] is None


async def test_growing_key_ranges_fold_the_last_into_the_one_before(
    table_db: TableDb, stack: Settings
) -> None:
    # Growing shards of 10,000 rows: 1,000, then 9,000 (4,000 + 5,000 folded), as a file's.
    shards = await jobs.check_table_job(
        job(table_db, shard_size=None), stack, stack.render_limits, create_output=True
    )
    assert shards is not None
    assert [(s.key_after, s.key_upto, s.row_count, s.first_row) for s in shards] == [
        (None, ticket_id(1000), 1000, 0),
        (ticket_id(1000), ticket_id(TICKETS), TICKETS - 1000, 1000),
    ]
    read = [await jobs.read_shard(s, stack, max_row_bytes=MAX) for s in shards]
    ids = [r.fields["code"] for rows in read for r in rows if r.fields is not None]
    assert ids == [ticket_id(n) for n in range(1, TICKETS + 1)]


async def test_a_row_over_max_row_bytes_is_its_own_error(
    table_db: TableDb, stack: Settings
) -> None:
    conn = await asyncpg.connect(table_db.dsn)
    await conn.execute("UPDATE tickets SET body = repeat('x', 500) WHERE code = $1", ticket_id(2))
    await conn.close()
    shards = await jobs.check_table_job(
        job(table_db), stack, stack.render_limits, create_output=True
    )
    assert shards is not None
    rows = await jobs.read_shard(shards[0], stack, max_row_bytes=400)
    assert len(rows) == 3000
    assert [r.error_class for r in rows[:3]] == [None, "RowTooLarge", None]
    assert rows[1].source.endswith(f"code={ticket_id(2)}")


async def test_query_input_keyed_by_id_field(table_db: TableDb, stack: Settings) -> None:
    spec = job(
        table_db,
        inputs=[
            table_db.query_uri("SELECT code, body, price, note FROM tickets WHERE price > 100")
        ],
        id_field="code",
        shard_size=5000,
    )
    shards = await jobs.check_table_job(spec, stack, stack.render_limits, create_output=True)
    assert shards is not None
    rows = [r for s in shards for r in await jobs.read_shard(s, stack, max_row_bytes=MAX)]
    # price > 100 from ticket 81 on.
    assert len(rows) == sum(s.row_count for s in shards) == TICKETS - 80
    assert rows[0].fields is not None and rows[0].fields["code"] == ticket_id(81)


async def test_query_that_writes_is_refused(table_db: TableDb, stack: Settings) -> None:
    conn = await asyncpg.connect(table_db.dsn)
    await conn.execute("CREATE SEQUENCE s")
    await conn.close()
    spec = job(
        table_db,
        inputs=[table_db.query_uri("SELECT code, body, nextval('s') AS n FROM tickets")],
        id_field="code",
        messages=[ChatMessage(role="user", content="{{ body }} {{ n }}")],
    )
    with pytest.raises(planning.InvalidJobSpec, match="read-only transaction") as caught:
        await jobs.check_table_job(spec, stack, stack.render_limits, create_output=False)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"inputs": ["TABLE"]}, "no such table"),
        ({"messages": [ChatMessage(role="user", content="{{ title }}")]}, "field(s) title"),
        ({"id_field": "nope"}, "'nope' is not a column"),
    ],
)
async def test_refusals(
    table_db: TableDb, stack: Settings, values: dict[str, object], says: str
) -> None:
    if values.get("inputs") == ["TABLE"]:
        values = {"inputs": [table_db.uri("missing")]}
    with pytest.raises(planning.InvalidJobSpec, match=None) as caught:
        await jobs.check_table_job(
            job(table_db, **values), stack, stack.render_limits, create_output=False
        )
    assert says in str(caught.value) and "\n" not in str(caught.value)


async def test_table_outside_allowed_tables_is_refused(table_db: TableDb, stack: Settings) -> None:
    narrow = stack.model_copy(
        update={"allowed_tables": f"127.0.0.1:{stack.postgres_port}/test_*/public.other"}
    )
    with pytest.raises(planning.InvalidJobSpec, match="outside the tables this worker may use"):
        await jobs.check_table_job(job(table_db), narrow, stack.render_limits, create_output=False)
    # Another server or database than a glob names is outside too.
    elsewhere = stack.model_copy(update={"allowed_tables": "127.0.0.1:1/*/*"})
    with pytest.raises(planning.InvalidJobSpec, match="outside"):
        await jobs.check_table_job(
            job(table_db), elsewhere, stack.render_limits, create_output=False
        )


async def test_snapshot_rule_rows_added_after_planning(table_db: TableDb, stack: Settings) -> None:
    """Rows with keys past the largest key at planning are the next run's; a change
    inside a range not yet fetched is seen when that shard is fetched."""
    shards = await jobs.check_table_job(
        job(table_db), stack, stack.render_limits, create_output=True
    )
    assert shards is not None
    conn = await asyncpg.connect(table_db.dsn)
    await conn.execute(
        "INSERT INTO tickets SELECT 'tk-' || lpad(g::text, 6, '0'), 'late ' || g, 1, NULL"
        " FROM generate_series($1::int, $2::int) g",
        TICKETS + 1,
        TICKETS + 500,
    )
    await conn.execute("UPDATE tickets SET body = 'changed' WHERE code = $1", ticket_id(9500))
    await conn.close()
    rows = [r for s in shards for r in await jobs.read_shard(s, stack, max_row_bytes=MAX)]
    assert len(rows) == TICKETS
    by_id = {r.fields["code"]: r.fields for r in rows if r.fields is not None}
    assert ticket_id(TICKETS + 1) not in by_id
    assert by_id[ticket_id(9500)]["body"] == "changed"


async def test_error_classes(table_db: TableDb, stack: Settings) -> None:
    table = parse_table_uri(table_db.uri("tickets"))
    async with connect(table, stack) as conn:
        with pytest.raises(asyncpg.UndefinedTableError) as missing:
            await conn.execute("SELECT * FROM nope")
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError) as read_only:
            async with conn.transaction(readonly=True):
                await conn.execute("DELETE FROM tickets")
        info = await source.inspect_source(conn, table, id_field=None)
    assert info.key == "code" and info.rows == TICKETS and info.key_type == "text"
    assert not is_transient(missing.value) and not is_transient(read_only.value)
    # A server that is not there: a retry may find it up.
    gone = parse_table_uri("postgresql://postgres@127.0.0.1:1/test_x?table=t")
    open_all = stack.model_copy(update={"allowed_tables": "*"})
    with pytest.raises(OSError) as refused:
        async with connect(gone, open_all):
            pass
    assert is_transient(refused.value)
    # A database that does not exist is permanent, in one line.
    no_db = parse_table_uri(
        f"postgresql://postgres@127.0.0.1:{stack.postgres_port}/test_none?table=t"
    )
    with pytest.raises(TableError, match="does not exist"):
        async with connect(no_db, stack):
            pass
