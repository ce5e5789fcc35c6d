"""With Postgres or Temporal away the API answers 503 with Retry-After within seconds
(OpenAI's clients retry those), not a 500 after a long wait. Real ``llm-batch serve``
whose connection to the backend goes through a TCP proxy the test stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from tests.fixtures.api_server import API_LIMITS, ApiServer, Keys
from tests.fixtures.tcp_proxy import TcpProxy
from tests.llmbatch.api.helpers import batch_file

PROMPTLY_S = 15.0


Call = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]


async def _down_answers_503(
    server: ApiServer, key: str, proxy: TcpProxy, call: Call, *, up: int
) -> None:
    """``call`` answers ``up`` while the backend is there, then 503 promptly."""
    await asyncio.to_thread(server.start)
    try:
        async with httpx.AsyncClient(
            base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as client:
            assert (await call(client)).status_code == up
            await proxy.stop()
            for _ in range(2):  # a pooled connection that died, then a new one refused
                started = time.monotonic()
                response = await call(client)
                assert time.monotonic() - started < PROMPTLY_S
                assert response.status_code == 503, response.text
                assert int(response.headers["Retry-After"]) > 0
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "server_error"
    finally:
        server.stop()


async def test_postgres_away_answers_503_with_retry_after(
    api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    dsn = urlsplit(api_server.settings.postgres_dsn.get_secret_value())
    key = await api_keys.new()
    async with TcpProxy(f"{dsn.hostname}:{dsn.port}") as proxy:
        via = dsn._replace(netloc=f"{dsn.username}@{proxy.address}")
        server = ApiServer(
            settings=api_server.settings,
            log=tmp_path / "serve.log",
            env={**API_LIMITS, "LLMBATCH_POSTGRES_DSN": urlunsplit(via)},
        )
        await _down_answers_503(server, key, proxy, lambda c: c.get("/files"), up=200)


async def test_temporal_away_answers_503_with_retry_after(
    api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    key = await api_keys.new()
    async with TcpProxy(api_server.settings.temporal_address) as proxy:
        server = ApiServer(
            settings=api_server.settings,
            log=tmp_path / "serve.log",
            env={**API_LIMITS, "LLMBATCH_TEMPORAL_ADDRESS": proxy.address},
        )
        await asyncio.to_thread(server.start)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            uploaded = await client.post(
                "/files",
                files={"file": ("in.jsonl", batch_file("no/such-model", 2))},
                data={"purpose": "batch"},
            )
        server.stop()
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        # Creating a batch asks Temporal who serves the model: 400 (nobody) while it is
        # there, 503 once it is gone.
        await _down_answers_503(server, key, proxy, lambda c: c.post("/batches", json=body), up=400)
