"""The provider of these tests: llm-batch's own ``llm-batch serve`` on the session stack
(its own project and key; its batches run on the session's GPU worker)."""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

import aiohttp
import pytest
import pytest_asyncio

from llmbatch.config import Settings
from llmbatch.provider.lines import request_line
from tests.fixtures.api_server import ApiServer, Keys
from tests.remote.conftest import KEY_ENV


class Provider(NamedTuple):
    """The job side's settings, and the provider: ``llm-batch serve``, a key of a
    project of its own, and the model it serves."""

    settings: Settings
    server: ApiServer
    key: str
    model: str


@pytest_asyncio.fixture
async def provider(
    workers: Settings,
    api_server: ApiServer,
    api_keys: Keys,
    served_model: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Provider:
    key = await api_keys.new(f"provider-{uuid.uuid4().hex[:6]}")
    # The CPU workers (this process, and the worker processes it starts) read the key
    # from their environment, as a deployment's do.
    monkeypatch.setenv(KEY_ENV, key)
    return Provider(workers, api_server, key, served_model)


async def provider_batches(server: ApiServer, key: str, job_id: str) -> list[dict[str, Any]]:
    """Every batch the provider holds for ``job_id`` (its metadata names the job), as
    its own /v1/batches list has them."""
    found: list[dict[str, Any]] = []
    after: str | None = None
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        while True:
            params = {"limit": "100", **({"after": after} if after else {})}
            async with http.get(f"{server.base_url}/batches", params=params) as response:
                assert response.status == 200, await response.text()
                page = await response.json()
            found += [b for b in page["data"] if (b.get("metadata") or {}).get("job") == job_id]
            if not page["has_more"]:
                return found
            after = page["data"][-1]["id"]


def rows_of(count: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "text": f"Say something about {i}."} for i in range(count)]


def wrong_url_on_every_line(custom_id: str, **kwargs: Any) -> tuple[str, bytes] | str:
    """Test double (a fault injector): the real request line sent to another URL than
    the batch's endpoint, a fault of the file (not of one line's body, which would be
    that line's 400), so the provider refuses the whole batch in validation."""
    made = request_line(custom_id, **kwargs)
    assert not isinstance(made, str)
    line = json.loads(made[1])
    line["url"] = "/v1/completions"
    return made[0], json.dumps(line).encode() + b"\n"
