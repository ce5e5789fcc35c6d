"""What a careless or hostile client sends is refused in OpenAI's error shape, and a
refused upload leaves nothing behind: a multipart body cut before its closing
boundary, NUL characters in ids, cursors, parameters, metadata and file names, and a
completion window with a trailing newline. Real ``llm-batch serve``, Postgres and S3."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmbatch.ledger import api_layout
from llmbatch.storage.s3 import S3Store
from tests.fixtures.api_server import API_LIMITS, ApiServer, Keys
from tests.llmbatch.api.helpers import batch_file

BOUNDARY = "llmbatch-test-boundary"


def api_objects(server: ApiServer) -> set[str]:
    """The keys of every object the API stored under its files prefix."""
    s3 = S3Store(server.settings).client
    keys: set[str] = set()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=server.settings.s3_bucket, Prefix=f"{api_layout.API_PREFIX}/files/"
    )
    for p in pages:
        keys.update(o["Key"] for o in p.get("Contents", []))
    return keys


def multipart(data: bytes, *, filename: str = "in.jsonl", closed: bool = True) -> bytes:
    head = (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode() if closed else b""
    return head + data + tail


def error_of(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    assert "s3://" not in error["message"]
    return dict(error)


async def http(server: ApiServer, keys: Keys) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=server.base_url,
        headers={"Authorization": f"Bearer {await keys.new()}"},
        timeout=30,
    )


async def test_a_multipart_body_cut_before_its_closing_boundary_is_refused_and_not_stored(
    api_server: ApiServer, api_keys: Keys
) -> None:
    lines = batch_file("m", 10).splitlines(keepends=True)
    before = api_objects(api_server)
    async with await http(api_server, api_keys) as client:
        # The body ends after the fifth line: no closing boundary (a client or proxy
        # that stopped mid-upload), though its Content-Length is honest.
        cut = multipart(b"".join(lines[:5]), closed=False)
        response = await client.post(
            "/files",
            content=cut,
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
        error_of(response, 400, "incomplete_upload")
        assert (await client.get("/files")).json()["data"] == []
        # The whole body, closed, is taken.
        whole = await client.post(
            "/files",
            content=multipart(b"".join(lines)),
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
        assert whole.status_code == 200, whole.text
        assert whole.json()["bytes"] == len(b"".join(lines))
    assert len(api_objects(api_server) - before) == 1


async def test_a_nul_anywhere_is_a_400_or_404_and_a_refused_upload_stores_nothing(
    api_server: ApiServer, api_keys: Keys
) -> None:
    before = api_objects(api_server)
    async with await http(api_server, api_keys) as client:
        named = await client.post(
            "/files",
            content=multipart(batch_file("m", 2), filename="in\x00.jsonl"),
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
        error_of(named, 400)
        assert api_objects(api_server) == before  # no object without a record
        assert (await client.get("/files")).json()["data"] == []

        for path in (
            "/files/file-%00abc",
            "/files/file-%00abc/content",
            "/batches/batch_%00abc",
        ):
            error_of(await client.get(path), 404, "not_found")
        error_of(await client.post("/batches/batch_%00abc/cancel"), 404, "not_found")
        error_of(await client.delete("/files/file-%00abc"), 404, "not_found")
        for path in (
            "/files?after=file-%00",
            "/files?purpose=batch%00",
            "/batches?after=batch_%00",
        ):
            error_of(await client.get(path), 400, "invalid_value")

        f = await client.post(
            "/files",
            content=multipart(batch_file("m", 2)),
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
        file_id = f.json()["id"]
        base = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        for body in (
            {**base, "metadata": {"k": "v\x00"}},
            {**base, "metadata": {"k\x00": "v"}},
            {**base, "input_file_id": file_id + "\x00"},
        ):
            response = await client.post(
                "/batches",
                content=json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            error_of(response, 400)
        assert (await client.get("/batches")).json()["data"] == []


@pytest.mark.parametrize("window", ["24h\n", " 24h", "24h ", "1h\r\n"])
async def test_a_completion_window_with_stray_whitespace_is_refused(
    api_server: ApiServer, api_keys: Keys, window: str
) -> None:
    async with await http(api_server, api_keys) as client:
        response = await client.post(
            "/batches",
            json={
                "input_file_id": "file-000000000000000000000000",
                "endpoint": "/v1/chat/completions",
                "completion_window": window,
            },
        )
        error = error_of(response, 400, "invalid_value")
        assert error["param"] == "completion_window"


async def test_a_server_killed_mid_upload_leaves_no_multipart_upload_for_ever(
    api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    env = {
        **API_LIMITS,
        "LLMBATCH_API_MAX_FILE_BYTES": str(64 << 20),
        "LLMBATCH_API_STALE_UPLOAD_AFTER": "PT3S",
    }
    server = ApiServer(settings=api_server.settings, log=tmp_path / "serve.log", env=env)
    await asyncio.to_thread(server.start)
    s3 = S3Store(api_server.settings).client
    bucket = api_server.settings.s3_bucket

    def open_uploads() -> list[str]:
        found = s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{api_layout.API_PREFIX}/files/")
        return [u["UploadId"] for u in found.get("Uploads", [])]

    held = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        # More than one 8 MiB part, then nothing more: the server has begun a multipart
        # upload and waits for the rest, which never comes.
        yield multipart(b"x" * (9 << 20), closed=False)
        await held.wait()

    try:
        async with httpx.AsyncClient(
            base_url=server.base_url,
            headers={"Authorization": f"Bearer {await api_keys.new()}"},
            timeout=60,
        ) as client:
            upload = asyncio.create_task(
                client.post(
                    "/files",
                    content=body(),
                    headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
                )
            )
            for _ in range(120):
                if open_uploads():
                    break
                await asyncio.sleep(0.5)
            assert open_uploads(), "the server never began a multipart upload"
            server.kill()  # mid-upload: nothing of the server runs on
            held.set()
            with contextlib.suppress(httpx.HTTPError):
                await upload
        # A server (this one again, or any replica) aborts what was left.
        await asyncio.to_thread(server.start)
        for _ in range(60):
            if not open_uploads():
                break
            await asyncio.sleep(0.5)
        assert open_uploads() == []
    finally:
        server.stop()


async def test_two_authorization_headers_are_refused(api_server: ApiServer, api_keys: Keys) -> None:
    good = f"Bearer {await api_keys.new()}"
    async with httpx.AsyncClient(base_url=api_server.base_url, timeout=30) as client:
        for headers in (
            [("Authorization", good), ("Authorization", "Bearer sk-wrong")],
            [("Authorization", "Bearer sk-wrong"), ("Authorization", good)],
            [("Authorization", good), ("Authorization", good)],
        ):
            error = error_of(await client.get("/files", headers=headers), 400)
            assert error["param"] == "Authorization"
        assert (await client.get("/files", headers={"Authorization": good})).status_code == 200


async def test_an_empty_file_is_refused_as_empty_not_as_missing_a_model(
    api_server: ApiServer, api_keys: Keys
) -> None:
    async with await http(api_server, api_keys) as client:
        for data in (b"", b"\n\n"):
            f = await client.post(
                "/files",
                content=multipart(data),
                headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
            )
            response = await client.post(
                "/batches",
                json={
                    "input_file_id": f.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            error_of(response, 400, "empty_file")
