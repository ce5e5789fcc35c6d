"""The provider's Files + Batches API over HTTP (OpenAI's shape), with aiohttp.

The key is read from the worker's environment as for online requests
(:meth:`llmbatch.remote.endpoints.Endpoint.api_key`) and goes only into the
``Authorization`` header; messages built here are scrubbed of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from llmbatch.errors import LlmBatchError
from llmbatch.remote.endpoints import Endpoint
from llmbatch.remote.http import scrub

# The metadata key that carries llm-batch's token for the batch (see provider_batches).
TOKEN_KEY = "llmbatch_token"
LIST_PAGE = 100

_decode = msgspec.json.Decoder().decode


class ProviderError(LlmBatchError, RuntimeError):
    """The provider answered with an error (or not at all); the activity retries."""


class BatchClient:
    """One endpoint's Files + Batches API; use as ``async with``."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._base = endpoint.base_url.rstrip("/")
        self._secret = endpoint.api_key() or ""
        headers = {"Authorization": f"Bearer {self._secret}"} if self._secret else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=endpoint.timeout_s, sock_connect=10),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def __aenter__(self) -> BatchClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            async with self._session.request(method, self._base + path, **kwargs) as response:
                raw = await response.read()
                if response.status >= 300:
                    raise ProviderError(
                        scrub(
                            f"{method} {path}: HTTP {response.status}: {raw[:300]!r}", self._secret
                        )
                    )
                return _decode(raw)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ProviderError(
                scrub(f"{method} {path}: {type(exc).__name__}: {exc}", self._secret)
            ) from None

    async def upload(self, data: bytes, *, filename: str) -> str:
        """Upload a requests file (purpose ``batch``); its file id."""
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename=filename, content_type="application/jsonl")
        body = await self._call("POST", "/files", data=form)
        return str(body["id"])

    async def create(
        self, *, input_file_id: str, url: str, window: str, metadata: dict[str, str]
    ) -> dict[str, Any]:
        body: dict[str, Any] = await self._call(
            "POST",
            "/batches",
            json={
                "input_file_id": input_file_id,
                "endpoint": url,
                "completion_window": window,
                "metadata": metadata,
            },
        )
        return body

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        body: dict[str, Any] = await self._call("GET", f"/batches/{batch_id}")
        return body

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        body: dict[str, Any] = await self._call("POST", f"/batches/{batch_id}/cancel")
        return body

    async def find(self, token: str) -> dict[str, Any] | None:
        """The batch whose metadata carries ``token``, if the provider has one: how a
        retry finds a batch created by an attempt that died before recording it."""
        after: str | None = None
        while True:
            params = {"limit": str(LIST_PAGE), **({"after": after} if after else {})}
            page = await self._call("GET", "/batches", params=params)
            for batch in page.get("data") or []:
                if (batch.get("metadata") or {}).get(TOKEN_KEY) == token:
                    return dict(batch)
            if not page.get("has_more") or not page.get("data"):
                return None
            after = page["data"][-1]["id"]

    async def lines(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's lines, streamed (an output file may be hundreds of MB)."""
        path = f"/files/{file_id}/content"
        try:
            async with self._session.get(self._base + path) as response:
                if response.status >= 300:
                    raw = await response.read()
                    raise ProviderError(
                        scrub(f"GET {path}: HTTP {response.status}: {raw[:300]!r}", self._secret)
                    )
                async for line in response.content:
                    if line.strip():
                        yield line
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ProviderError(
                scrub(f"GET {path}: {type(exc).__name__}: {exc}", self._secret)
            ) from None
