"""``/v1/batches``: what is refused at creation, in OpenAI's error shape, and what a
created batch looks like through the official client."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import openai
import pytest

from llmbatch.config import Settings
from llmbatch.contract.spec import Task
from llmbatch.ledger import api_layout, served_models
from tests.fixtures.api_server import CAPPED_PROJECT, ApiServer, Keys
from tests.llmbatch.api.helpers import assert_openai_error, batch_file, record_unstarted_batch


async def test_a_batch_for_a_model_no_worker_serves_is_refused(
    api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    f = await client.files.create(
        file=("in.jsonl", batch_file("no/such-model", 2)), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    error = assert_openai_error(caught.value, status=400, code="model_not_found", param="model")
    assert "no/such-model" in error["message"]
    assert (await client.batches.list()).data == []


async def test_a_batch_for_a_model_served_before_is_accepted_and_waits(
    workers: Settings, api_server: ApiServer, api_keys: Keys, api_pool: asyncpg.Pool
) -> None:
    """Workers scaled to zero: a model some worker served before (its queue recorded in
    served_models) is declared, so its batch is accepted and waits for a worker."""
    model = f"scaled-to-zero/{uuid.uuid4().hex[:8]}"
    queue = api_server.settings.gpu_task_queue(model, Task.GENERATE)
    await served_models.record_served_model(
        api_pool,
        served_models.ServedQueue(
            task_queue=queue, model=model, task=Task.GENERATE, identity="1@gone"
        ),
    )
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    f = await client.files.create(file=("in.jsonl", batch_file(model, 2)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status in {"validating", "in_progress"}
    counts = (await client.batches.retrieve(batch.id)).request_counts
    assert counts is not None and counts.completed == 0
    cancelled = await client.batches.cancel(batch.id)
    assert cancelled.status in {"cancelling", "cancelled"}


async def test_bad_parameters_answer_400_in_openais_shape(
    api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    f = await client.files.create(file=("in.jsonl", batch_file("m", 2)), purpose="batch")
    # Each case overrides one parameter with a value the server refuses.
    cases: list[tuple[dict[str, Any], str]] = [
        ({"completion_window": "48h"}, "completion_window"),
        ({"endpoint": "/v1/images/generations"}, "endpoint"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ]
    for kwargs, param in cases:
        create: dict[str, Any] = {
            "input_file_id": f.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **kwargs,
        }
        with pytest.raises(openai.BadRequestError) as caught:
            await client.batches.create(**create)
        assert_openai_error(caught.value, status=400, param=param)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert_openai_error(missing.value, status=404, param="input_file_id")
    with pytest.raises(openai.NotFoundError) as route:
        await client.get("/nowhere", cast_to=object)
    assert_openai_error(route.value, status=404)


async def test_limits_answer_400_and_429(
    served_model: str,
    api_server: ApiServer,
    api_keys: Keys,
    api_pool: asyncpg.Pool,
) -> None:
    project = "limits-" + api_layout.new_file_id()[-8:]
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(project), max_retries=0
    )
    # The session server takes at most 200 requests a batch.
    many = await client.files.create(
        file=("many.jsonl", batch_file(served_model, 201)), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        await client.batches.create(
            input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert_openai_error(caught.value, status=400, code="too_many_requests_in_batch")

    # ... and 2 unfinished batches a project: two are recorded as the server records
    # them, so none can finish before the third is asked for.
    f = await client.files.create(file=("in.jsonl", batch_file(served_model, 2)), purpose="batch")
    for _ in range(2):
        await record_unstarted_batch(
            api_pool, project=project, input_file_id=f.id, model=served_model
        )
    with pytest.raises(openai.RateLimitError) as limited:
        await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert_openai_error(limited.value, status=429, code="too_many_batches_in_progress")
    page = await client.batches.list()
    assert len(page.data) == 2 and page.has_more is False
    # The input of an unfinished batch stays until the batch ends.
    with pytest.raises(openai.BadRequestError) as in_use:
        await client.files.delete(f.id)
    assert_openai_error(in_use.value, status=400, code="file_in_use")


async def test_an_operators_quota_caps_a_projects_batches_in_progress(
    served_model: str, api_server: ApiServer, api_keys: Keys, api_pool: asyncpg.Pool
) -> None:
    """The session server lets every project have 2 batches in progress, and its
    LLMBATCH_TENANT_QUOTAS lets CAPPED_PROJECT have 1: its second answers 429."""
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(CAPPED_PROJECT), max_retries=0
    )
    f = await client.files.create(file=("in.jsonl", batch_file(served_model, 2)), purpose="batch")
    await record_unstarted_batch(
        api_pool, project=CAPPED_PROJECT, input_file_id=f.id, model=served_model
    )
    with pytest.raises(openai.RateLimitError) as limited:
        await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    error = assert_openai_error(limited.value, status=429, code="too_many_batches_in_progress")
    assert "has 1 batches in progress" in error["message"]
    assert "max_concurrent_jobs in LLMBATCH_TENANT_QUOTAS" in error["message"]
