"""OpenAI Batch API batches on the real stack, started the way `llm-batch serve` starts
them (an uploaded file in the object store, an api_batches row, BatchJobWorkflow with
``spec.api_batch``), without HTTP: validation, completion, expiry and cancel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError

from llmbatch import ledger, storage
from llmbatch.client.temporal import start_api_batch
from llmbatch.config import Settings
from llmbatch.contract.messages import ApiBatchRecordInput, JobControlState, JobSummary
from llmbatch.contract.names import PAUSE_UPDATE
from llmbatch.contract.spec import ApiBatch, ApiEndpoint, InputFormat, JobSpec
from llmbatch.contract.states import BatchStatus, ItemStatus, JobState
from llmbatch.ledger import api_layout
from llmbatch.workflows.batch_job import BatchJobWorkflow
from tests.fixtures.replay import replayer
from tests.llmbatch.cli.test_control import eventually
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

GUARD_S = 300.0
POLL_S = 0.2
PROJECT = "proj-flow"


@pytest_asyncio.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await ledger.db.create_pool(pg_dsn, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


def chat_line(custom_id: str, model: str, text: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            **body,
        },
    }


def completion_line(custom_id: str, model: str, prompt: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": prompt, "max_tokens": 4, **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


async def start_batch(
    settings: Settings,
    client: Client,
    pool: asyncpg.Pool,
    data: bytes,
    *,
    model: str,
    endpoint: ApiEndpoint = ApiEndpoint.CHAT_COMPLETIONS,
    window_s: int = 24 * 3600,
    **spec: Any,
) -> WorkflowHandle[Any, JobSummary]:
    """Upload ``data`` as an API file and start the batch's job, whose workflow writes
    its batch row: as the server does."""
    file_id, batch_id = api_layout.new_file_id(), api_layout.new_batch_id()
    uri = api_layout.file_uri(settings.s3_bucket, file_id)
    storage.stores.open_store(uri, settings).put_bytes(uri, data)
    await pool.execute(
        "INSERT INTO api_files (file_id, project, purpose, filename, bytes, object_uri) "
        "VALUES ($1, $2, 'batch', 'in.jsonl', $3, $4)",
        file_id,
        PROJECT,
        len(data),
        uri,
    )
    job = JobSpec(
        job_id=batch_id,
        inputs=[uri],
        input_format=InputFormat.OPENAI,
        model=model,
        output_uri=api_layout.batch_output_uri(settings.s3_bucket),
        api_batch=ApiBatch(project=PROJECT, endpoint=endpoint, completion_window_s=window_s),
        **spec,
    )
    record = ApiBatchRecordInput(
        batch_id=batch_id,
        project=PROJECT,
        input_file_id=file_id,
        endpoint=endpoint.value,
        completion_window="24h",
        window_s=window_s,
        model=model,
        max_in_progress=100,
    )
    await start_api_batch(client, job, record, settings=settings)
    return client.get_workflow_handle(batch_id, result_type=JobSummary)


async def batch_status(pool: asyncpg.Pool, batch_id: str) -> str:
    return str(await pool.fetchval("SELECT status FROM api_batches WHERE batch_id = $1", batch_id))


async def batch_row(pool: asyncpg.Pool, batch_id: str) -> dict[str, Any]:
    row = await pool.fetchrow("SELECT * FROM api_batches WHERE batch_id = $1", batch_id)
    assert row is not None
    return dict(row)


def file_lines(settings: Settings, pool_row: dict[str, Any]) -> list[dict[str, Any]]:
    store = storage.stores.open_store(pool_row["object_uri"], settings)
    data = store.read_bytes(pool_row["object_uri"])
    assert len(data) == pool_row["bytes"]
    return [json.loads(line) for line in data.splitlines()]


async def batch_files(
    settings: Settings, pool: asyncpg.Pool, batch: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The lines of the batch's output and error files (empty when it has none),
    each checked to be registered as a ``batch_output`` file of the batch's project."""
    found: list[list[dict[str, Any]]] = []
    for column, kind in (("output_file_id", "output"), ("error_file_id", "error")):
        file_id = batch[column]
        if file_id is None:
            found.append([])
            continue
        row = await pool.fetchrow("SELECT * FROM api_files WHERE file_id = $1", file_id)
        assert row is not None
        assert (row["purpose"], row["project"]) == ("batch_output", PROJECT)
        assert row["filename"] == f"{batch['batch_id']}_{kind}.jsonl"
        found.append(file_lines(settings, dict(row)))
    return found[0], found[1]


async def replays(client: Client, handle: WorkflowHandle[Any, JobSummary]) -> None:
    """The batch's history replays on today's code: its new steps are deterministic."""
    replaying = replayer([BatchJobWorkflow], data_converter=client.data_converter)
    await replaying.replay_workflow(await handle.fetch_history())


async def until(condition: Any) -> None:
    """Poll ``condition`` (another process's writes to the ledger: nothing to await)."""
    for _ in range(int(GUARD_S / POLL_S)):
        if await condition():
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError("condition not met in time")


async def test_broken_lines_fail_the_batch_with_their_lines_and_codes_before_any_generation(
    workers: Settings, temporal_client: Client, pool: asyncpg.Pool, model_name: str
) -> None:
    lines = [
        chat_line("a", model_name, "hi"),
        b"{not json",
        {"custom_id": "c", "url": "/v1/chat/completions", "body": {}},
        chat_line("a", model_name, "again"),
        {**chat_line("e", model_name, "hi"), "url": "/v1/completions"},
        chat_line("f", "another-model", "hi"),
        {**chat_line("g", model_name, "hi"), "method": "GET"},
    ]
    handle = await start_batch(workers, temporal_client, pool, jsonl(lines), model=model_name)
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), GUARD_S)
    batch = await batch_row(pool, handle.id)
    assert batch["status"] == BatchStatus.FAILED
    assert batch["failed_at"] is not None and batch["in_progress_at"] is None
    errors = batch["errors"]
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "method"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "url_mismatch", "url"),
        (6, "model_mismatch", "body.model"),
        (7, "invalid_method", "method"),
    ]
    assert all(e["message"] for e in errors)
    # Nothing ran: no item in the ledger, no job row, no files.
    assert await pool.fetchval("SELECT count(*) FROM items WHERE job_id = $1", handle.id) == 0
    assert batch["output_file_id"] is None and batch["error_file_id"] is None


@pytest.mark.parametrize("endpoint", [ApiEndpoint.CHAT_COMPLETIONS, ApiEndpoint.COMPLETIONS])
async def test_a_good_batch_completes_with_one_output_and_one_error_file_in_input_order(
    workers: Settings,
    temporal_client: Client,
    pool: asyncpg.Pool,
    model_name: str,
    endpoint: ApiEndpoint,
) -> None:
    make = chat_line if endpoint is ApiEndpoint.CHAT_COMPLETIONS else completion_line
    ids = [f"req-{i}" for i in range(7)]
    # stream=true cannot run in a batch: that request alone fails (its 400).
    failing = {"req-3"}
    lines = [
        make(c, model_name, f"Say {i}", **({"stream": True} if c in failing else {}))
        for i, c in enumerate(ids)
    ]
    handle = await start_batch(
        workers,
        temporal_client,
        pool,
        jsonl(lines),
        model=model_name,
        endpoint=endpoint,
        shard_size=3,
    )
    summary = await asyncio.wait_for(handle.result(), GUARD_S)
    assert summary.state == JobState.COMPLETED_WITH_ERRORS
    batch = await batch_row(pool, handle.id)
    assert batch["status"] == BatchStatus.COMPLETED
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert batch[stamp] is not None, stamp
    assert batch["in_progress_at"] <= batch["finalizing_at"] <= batch["completed_at"]
    out, err = await batch_files(workers, pool, batch)
    assert [x["custom_id"] for x in out] == [c for c in ids if c not in failing]
    assert [x["custom_id"] for x in err] == sorted(failing)
    body = out[0]["response"]["body"]
    if endpoint is ApiEndpoint.COMPLETIONS:
        assert body["object"] == "text_completion"
        assert set(body["choices"][0]) == {"text", "index", "finish_reason", "logprobs"}
    else:
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["total_tokens"] == (
        body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    assert err[0]["error"]["code"] == "InvalidRequest"
    assert err[0]["response"]["status_code"] == 400
    await replays(temporal_client, handle)


async def run_until_first_shard_done_then_pause(
    handle: WorkflowHandle[Any, JobSummary], pool: asyncpg.Pool
) -> None:
    """Wait until the first shard's requests have succeeded, then pause the job so no
    other shard starts: what is done and what is not is then fixed."""

    async def first_shard_done() -> bool:
        rows = await ledger.items.shard_results(pool, job_id=handle.id, shard=0)
        if bool(rows) and all(r.status is ItemStatus.SUCCEEDED for r in rows):
            return True
        # Say so at once if the batch ended first (its window passed on a slow machine).
        assert await batch_status(pool, handle.id) in ("validating", "in_progress")
        return False

    await until(first_shard_done)
    control = await handle.execute_update(PAUSE_UPDATE, result_type=JobControlState)
    assert control.paused


async def check_partial(
    settings: Settings, pool: asyncpg.Pool, batch: dict[str, Any], ids: list[str], *, code: str
) -> int:
    """Every request is in exactly one of the two files, each in input order: the first
    shard's (done before the pause) in the output, the last shard's (never started)
    in the error file with ``code``; the middle shard's may have run before the pause
    reached it. Returns how many succeeded."""
    out, err = await batch_files(settings, pool, batch)
    out_ids, err_ids = [x["custom_id"] for x in out], [x["custom_id"] for x in err]
    assert sorted(out_ids + err_ids) == sorted(ids)
    assert out_ids == [c for c in ids if c in set(out_ids)]
    assert err_ids == [c for c in ids if c in set(err_ids)]
    assert set(ids[:2]) <= set(out_ids) and set(ids[4:]) <= set(err_ids)
    assert {x["error"]["code"] for x in err} == {code}
    counts = await ledger.jobs.job_counts(pool, job_id=batch["batch_id"])
    assert counts.succeeded == len(out_ids)
    return len(out_ids)


async def test_a_short_window_expires_keeping_finished_results(
    workers: Settings, temporal_client: Client, pool: asyncpg.Pool, model_name: str
) -> None:
    ids = [f"e-{i}" for i in range(6)]
    lines = [chat_line(c, model_name, f"Say {c}") for c in ids]
    handle = await start_batch(
        workers,
        temporal_client,
        pool,
        jsonl(lines),
        model=model_name,
        # Long enough for the first shard of two tiny requests on a loaded machine; the
        # test waits for it, then for the window (the test's one fixed wait).
        window_s=30,
        shard_size=2,
        max_concurrent_shards=1,
    )
    await run_until_first_shard_done_then_pause(handle, pool)
    summary = await asyncio.wait_for(handle.result(), GUARD_S)
    assert summary.state == JobState.EXPIRED
    batch = await batch_row(pool, handle.id)
    assert batch["status"] == BatchStatus.EXPIRED and batch["expired_at"] is not None
    done = await check_partial(workers, pool, batch, ids, code="batch_expired")
    assert (summary.items_succeeded, summary.items_dead) == (done, len(ids) - done)
    row = await pool.fetchrow(
        "SELECT status, items_succeeded, items_dead FROM jobs WHERE job_id = $1", handle.id
    )
    assert row is not None
    assert (row["status"], row["items_succeeded"], row["items_dead"]) == (
        JobState.EXPIRED,
        done,
        len(ids) - done,
    )

    # The CLI names the job's state: `status` from its summary, `list` from its memo.
    code, out, err = await cli(workers, "status", handle.id, "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == JobState.EXPIRED

    async def listed() -> dict[str, Any] | None:
        code, out, err = await cli(workers, "list", "--json", "--limit", "100")
        assert code == 0, err
        row = {r["job_id"]: r for r in json.loads(out)}.get(handle.id)
        return row if row and row["status"] == "completed" else None  # visibility lags

    listed_row = await eventually(listed, within_s=30)
    assert listed_row["state"] == JobState.EXPIRED
    await replays(temporal_client, handle)


async def test_cancel_mid_way_ends_cancelled_with_partial_results(
    workers: Settings, temporal_client: Client, pool: asyncpg.Pool, model_name: str
) -> None:
    ids = [f"c-{i}" for i in range(6)]
    lines = [chat_line(c, model_name, f"Say {c}") for c in ids]
    handle = await start_batch(
        workers,
        temporal_client,
        pool,
        jsonl(lines),
        model=model_name,
        shard_size=2,
        max_concurrent_shards=1,
    )
    await run_until_first_shard_done_then_pause(handle, pool)
    await pool.execute(
        "UPDATE api_batches SET status = 'cancelling', cancelling_at = now() WHERE batch_id = $1",
        handle.id,
    )
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await asyncio.wait_for(handle.result(), GUARD_S)
    assert isinstance(ended.value.cause, CancelledError)
    batch = await batch_row(pool, handle.id)
    assert batch["status"] == BatchStatus.CANCELLED and batch["cancelled_at"] is not None
    await check_partial(workers, pool, batch, ids, code="batch_cancelled")
    await replays(temporal_client, handle)
