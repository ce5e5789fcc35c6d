"""``GET /v1/models`` lists what live GPU workers serve; ``GET /v1/models/{id}`` gets one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from llmbatch.contract.names import model_identity
from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.embed_worker import EmbedWorker
from tests.llmbatch.api.helpers import assert_openai_error


async def test_models_lists_the_session_gpu_workers_model(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    # served_model waited until the list named the worker's model: what is left to
    # check is how the model is shown.
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    models = [m async for m in client.models.list()]
    # One entry per model, with its tasks: the same weights may also serve embed
    # workers (the embed tests run the tiny model as one).
    [served] = [m for m in models if m.id == served_model]
    assert served.object == "model" and served.owned_by == "llm-batch"
    assert "generate" in (served.model_extra or {})["tasks"]


async def test_a_model_served_for_two_tasks_is_listed_once_with_both(
    served_model: str, embed_worker: EmbedWorker, api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    # The same weights, as generate and embed (loaded from one path, listed by its name).
    assert model_identity(embed_worker.model) == served_model
    for _ in range(120):
        listed = [m for m in [m async for m in client.models.list()] if m.id == served_model]
        if len(listed) > 1 or "embed" in (listed[0].model_extra or {}).get("tasks", []):
            break
        await asyncio.sleep(0.5)
    assert len(listed) == 1, listed
    assert (listed[0].model_extra or {})["tasks"] == ["embed", "generate"]


async def test_a_served_model_is_retrieved_by_its_id_and_an_unknown_one_is_404(
    served_model: str, model_name: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    model = await client.models.retrieve(served_model)
    assert model.id == served_model and model.object == "model"
    assert (model.model_extra or {}).get("task") in ("generate", "embed")
    # The worker loaded the tiny model from a local path: it is listed by the folder's
    # name and a hash of the path, and retrieved by either (the path's slashes reach
    # the route whole).
    assert "/" not in served_model and served_model.startswith(Path(model_name).name + "-")
    assert (await client.models.retrieve(model_name)).id == served_model
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("no-such-model")
    assert_openai_error(caught.value, status=404, param="model")
