"""Batches through the official client on a real ``llm-batch serve``, the session's
workers and engine: upload, create, poll, download and match by ``custom_id``; broken
lines; cancel and expiry mid-batch; the server SIGKILLed mid-batch and started again.

The test server runs batches in shards of 2, one at a time (tests/fixtures/api_server.py),
so a test can pause a batch between shards (as `llm-batch pause` does: the rest of
llm-batch sees a batch as a job) with some requests done and some not.
"""

from __future__ import annotations

import asyncio
from typing import Final

import openai
import pytest
from openai.types import Batch
from temporalio.client import Client

from llmbatch.contract.messages import JobControlState
from llmbatch.contract.names import PAUSE_UPDATE
from tests.fixtures.api_server import ApiServer, Keys
from tests.llmbatch.api.helpers import jsonl, lines_of, new_client, request_line, until

pytestmark = pytest.mark.slow

CHAT: Final = "/v1/chat/completions"


async def test_a_batch_completes_and_its_files_answer_every_request_by_custom_id(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, key = await new_client(api_server, api_keys)
    lines = [request_line(served_model, n) for n in range(5)]
    lines[2]["body"]["stream"] = True  # refused when the request is built: it alone fails
    ids = [x["custom_id"] for x in lines]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"team": "search"}
    )
    # Create answers with the batch as recorded when it answers: validating, or already
    # in_progress when the job was planned first (five rows on a quiet machine can be).
    assert created.status in ("validating", "in_progress") and created.model == served_model
    assert created.metadata == {"team": "search"} and created.expires_at is not None

    batch = await until(
        client, created.id, lambda b: b.status not in ("validating", "in_progress", "finalizing")
    )
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.usage is not None
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert created.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at

    out = await lines_of(client, batch.output_file_id)
    err = await lines_of(client, batch.error_file_id)
    assert [x["custom_id"] for x in out] == [c for c in ids if c != "req-2"]
    assert [x["custom_id"] for x in err] == ["req-2"]
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["model"] == served_model
    assert batch.output_file_id is not None and batch.error_file_id is not None
    outputs = [f.id async for f in client.files.list(purpose="batch_output")]
    assert sorted(outputs) == sorted([batch.output_file_id, batch.error_file_id])

    # The sync client reads the same batch; the list pages it.
    sync = openai.OpenAI(base_url=api_server.base_url, api_key=key, max_retries=0)
    assert await asyncio.to_thread(lambda: sync.batches.retrieve(created.id).model_dump()) == (
        batch.model_dump()
    )
    assert [b.id async for b in client.batches.list(limit=1)] == [created.id]


async def test_broken_lines_fail_the_batch_with_their_line_numbers(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [
        request_line(served_model, 0),
        b"{not json",
        request_line(served_model, 0),  # a custom_id again
        {**request_line(served_model, 3), "url": "/v1/completions"},
    ]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h"
    )
    batch = await until(client, created.id, lambda b: b.status == "failed")
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "url_mismatch"),
    ]
    assert all(e.message for e in batch.errors.data)
    assert batch.failed_at and batch.in_progress_at is None and batch.output_file_id is None
    assert batch.request_counts is not None and batch.request_counts.completed == 0


async def pause_after_first_shard(
    client: openai.AsyncOpenAI, temporal_client: Client, batch_id: str
) -> None:
    """Once the first shard's requests are done, pause the batch's job (as `llm-batch
    pause` does) so no further shard starts."""
    await until(
        client,
        batch_id,
        lambda b: b.request_counts is not None and b.request_counts.completed >= 2,
    )
    state = await temporal_client.get_workflow_handle(batch_id).execute_update(
        PAUSE_UPDATE, result_type=JobControlState
    )
    assert state.paused


async def check_partial(
    client: openai.AsyncOpenAI, batch: Batch, ids: list[str], *, code: str
) -> None:
    """Every request is in one of the two files, in input order: the first shard's in
    the output, the last shard's (never started) in the error file with ``code``."""
    out = [x["custom_id"] for x in await lines_of(client, batch.output_file_id)]
    err_lines = await lines_of(client, batch.error_file_id)
    err = [x["custom_id"] for x in err_lines]
    assert sorted(out + err) == sorted(ids)
    assert out == [c for c in ids if c in out] and err == [c for c in ids if c in err]
    assert set(ids[:2]) <= set(out) and set(ids[-2:]) <= set(err)
    assert {x["error"]["code"] for x in err_lines} == {code}
    assert batch.request_counts is not None
    assert batch.request_counts.completed == len(out)


async def test_cancel_mid_batch_keeps_what_finished(
    served_model: str, api_server: ApiServer, api_keys: Keys, temporal_client: Client
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [request_line(served_model, n) for n in range(6)]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h"
    )
    await pause_after_first_shard(client, temporal_client, created.id)
    cancelling = await client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = await until(client, created.id, lambda b: b.status == "cancelled")
    assert batch.cancelled_at is not None and batch.cancelling_at == cancelling.cancelling_at
    await check_partial(client, batch, [x["custom_id"] for x in lines], code="batch_cancelled")
    with pytest.raises(openai.BadRequestError):
        await client.batches.cancel(created.id)


async def test_a_short_completion_window_expires_the_batch(
    served_model: str, api_server: ApiServer, api_keys: Keys, temporal_client: Client
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [request_line(served_model, n) for n in range(6)]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id,
        endpoint=CHAT,
        # llm-batch serve takes any window; the client's types allow OpenAI's "24h" only.
        completion_window="20s",  # type: ignore[arg-type]
    )
    assert created.completion_window == "20s"
    assert created.expires_at is not None and created.expires_at - created.created_at in (
        19,
        20,
        21,
    )
    await pause_after_first_shard(client, temporal_client, created.id)
    batch = await until(client, created.id, lambda b: b.status == "expired")
    assert batch.expired_at is not None
    await check_partial(client, batch, [x["custom_id"] for x in lines], code="batch_expired")


async def test_the_server_killed_mid_batch_and_started_again_loses_nothing(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [request_line(served_model, n) for n in range(6)]
    ids = [x["custom_id"] for x in lines]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h"
    )
    api_server.kill()
    with pytest.raises(openai.APIConnectionError):
        await client.batches.retrieve(created.id)
    await asyncio.to_thread(api_server.start)  # same port, a new process

    batch = await until(client, created.id, lambda b: b.status == "completed")
    assert batch.request_counts is not None
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    out = await lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ids  # each once, in input order
    assert await lines_of(client, batch.error_file_id) == []
    assert [b.id async for b in client.batches.list()] == [created.id]
