"""A batch's record never outlives its workflow: a server killed the moment a batch's
record is committed leaves a batch that still runs to its end, and a record with no
workflow (as a server of before Update-with-Start left one) is ended by its cancel."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import asyncpg
import openai
import pytest

from llmbatch.ledger import api_layout
from tests.fixtures.api_server import API_LIMITS, ApiServer, Keys
from tests.fixtures.tcp_proxy import TcpProxy
from tests.llmbatch.api.helpers import batch_file, record_unstarted_batch

FINAL = {"completed", "failed", "expired", "cancelled"}


async def final_status(pool: asyncpg.Pool, batch_id: str, *, within_s: float) -> str | None:
    """The batch's status once final (None when it has no record), or the last one seen
    when ``within_s`` passes."""
    deadline = time.monotonic() + within_s
    while True:
        status = await pool.fetchval("SELECT status FROM api_batches WHERE batch_id = $1", batch_id)
        if status is None or status in FINAL or time.monotonic() > deadline:
            return None if status is None else str(status)
        await asyncio.sleep(0.5)


async def test_a_server_killed_once_the_record_is_committed_leaves_a_batch_that_ends(
    served_model: str,
    api_server: ApiServer,
    api_keys: Keys,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
) -> None:
    key = await api_keys.new()
    temporal = api_server.settings.temporal_address
    # Temporal slowed (a real one cannot be made slow on demand): the server's start of
    # the workflow comes well after its record is committed, as a slow network has it.
    async with TcpProxy(temporal, delay_s=0.5) as via:
        doomed = ApiServer(
            settings=api_server.settings,
            log=tmp_path / "doomed.log",
            env={**API_LIMITS, "LLMBATCH_TEMPORAL_ADDRESS": via.address},
        )
        await asyncio.to_thread(doomed.start)
        client = openai.AsyncOpenAI(base_url=doomed.base_url, api_key=key, max_retries=0)
        f = await client.files.create(
            file=("in.jsonl", batch_file(served_model, 2)), purpose="batch"
        )
        recorded: asyncio.Queue[str] = asyncio.Queue()

        def on_insert(conn: object, pid: int, channel: str, batch_id: str) -> None:
            # The moment the record is committed: the server dies, as a lost machine.
            doomed.kill()
            recorded.put_nowait(batch_id)

        listener = await asyncpg.connect(api_server.settings.postgres_dsn.get_secret_value())
        try:
            await listener.execute(
                """
                CREATE OR REPLACE FUNCTION test_api_batch_recorded() RETURNS trigger AS $$
                BEGIN PERFORM pg_notify('api_batch_recorded', NEW.batch_id); RETURN NEW; END
                $$ LANGUAGE plpgsql;
                DROP TRIGGER IF EXISTS test_api_batch_recorded ON api_batches;
                CREATE TRIGGER test_api_batch_recorded AFTER INSERT ON api_batches
                FOR EACH ROW EXECUTE FUNCTION test_api_batch_recorded();
                """
            )
            await listener.add_listener("api_batch_recorded", on_insert)
            create = asyncio.create_task(
                client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            )
            batch_id = await asyncio.wait_for(recorded.get(), 60)
            with pytest.raises(openai.APIConnectionError):
                await create
        finally:
            await listener.execute(
                "DROP TRIGGER IF EXISTS test_api_batch_recorded ON api_batches; "
                "DROP FUNCTION IF EXISTS test_api_batch_recorded()"
            )
            await listener.close()
            doomed.kill()
    # Whoever wrote the record, a workflow ends the batch: it does not stay validating.
    assert await final_status(api_pool, batch_id, within_s=120) == "completed"
    live = openai.AsyncOpenAI(base_url=api_server.base_url, api_key=key, max_retries=0)
    batch = await live.batches.retrieve(batch_id)
    assert batch.request_counts is not None and batch.request_counts.completed == 2
    data = await (await live.files.content(batch.output_file_id or "")).aread()
    assert sorted(json.loads(line)["custom_id"] for line in data.splitlines()) == [
        "req-0",
        "req-1",
    ]


async def test_cancelling_a_batch_without_a_workflow_ends_it(
    served_model: str, api_server: ApiServer, api_keys: Keys, api_pool: asyncpg.Pool
) -> None:
    project = "orphan-" + api_layout.new_file_id()[-8:]
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(project), max_retries=0
    )
    f = await client.files.create(file=("in.jsonl", batch_file(served_model, 2)), purpose="batch")
    # A record whose workflow never started, as a server that died between writing it
    # and starting the workflow left it before Update-with-Start.
    batch_id = await record_unstarted_batch(
        api_pool, project=project, input_file_id=f.id, model=served_model
    )
    cancelled = await client.batches.cancel(batch_id)
    assert cancelled.status == "cancelled"
    assert cancelled.cancelled_at is not None
    # It no longer holds its input, nor a place in the project's in-progress limit.
    assert (await client.files.delete(f.id)).deleted
