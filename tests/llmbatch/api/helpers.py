"""Batch input files, clients, polling and error-shape checks shared by the API tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import asyncpg
import openai
from openai.types import Batch

from llmbatch.contract.spec import ApiEndpoint
from llmbatch.ledger import api_layout, api_records
from tests.fixtures.api_server import ApiServer, Keys


def request_line(
    model: str,
    n: int,
    *,
    endpoint: ApiEndpoint = ApiEndpoint.CHAT_COMPLETIONS,
    max_tokens: int = 8,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if endpoint is ApiEndpoint.CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": f"Say something about {n}."}]
    else:
        body["prompt"] = f"Something about {n}:"
    return {"custom_id": f"req-{n}", "method": "POST", "url": str(endpoint), "body": body}


def batch_file(model: str, count: int, **kwargs: Any) -> bytes:
    return b"".join(
        json.dumps(request_line(model, n, **kwargs)).encode() + b"\n" for n in range(count)
    )


def assert_openai_error(
    exc: openai.APIStatusError, *, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The answer is ``status`` in OpenAI's error shape (and has ``code``/``param``)."""
    assert exc.status_code == status, exc
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


GUARD_S = 300.0
POLL_S = 0.25


async def until(client: openai.AsyncOpenAI, batch_id: str, done: Callable[[Batch], bool]) -> Batch:
    """Poll the batch until ``done`` holds (a guard ends a hung test, nothing else)."""
    for _ in range(int(GUARD_S / POLL_S)):
        batch = await client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    meta = await client.files.retrieve(file_id)
    assert meta.purpose == "batch_output"
    data = await (await client.files.content(file_id)).aread()
    assert len(data) == meta.bytes
    return [json.loads(line) for line in data.splitlines()]


ENDED = ("completed", "failed", "expired", "cancelled")


async def submit(
    client: openai.AsyncOpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions"
) -> Batch:
    """Upload ``lines`` as a batch file, create its batch, and wait for it to end."""
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    return await until(client, created.id, lambda b: b.status in ENDED)


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


async def new_client(api_server: ApiServer, api_keys: Keys) -> tuple[openai.AsyncOpenAI, str]:
    key = await api_keys.new()
    return openai.AsyncOpenAI(base_url=api_server.base_url, api_key=key, max_retries=0), key


async def record_unstarted_batch(
    pool: asyncpg.Pool, *, project: str, input_file_id: str, model: str
) -> str:
    """A batch record with no workflow behind it (as a server of before Update-with-Start
    left one when it died between the two); its id."""
    batch_id = api_layout.new_batch_id()
    await api_records.insert_batch(
        pool,
        batch_id=batch_id,
        project=project,
        input_file_id=input_file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window=timedelta(hours=24),
        model=model,
        metadata=None,
        max_in_progress=10,
    )
    return batch_id
