"""``/v1/files`` through the official client, sync and async, on a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fixtures.api_server import ApiServer, Keys
from tests.llmbatch.api.helpers import assert_openai_error, batch_file


async def test_upload_list_page_get_download_delete_with_the_sync_client(
    api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.OpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    contents = [batch_file("m", n + 1) for n in range(3)]
    uploaded = [
        client.files.create(file=(f"in-{n}.jsonl", data), purpose="batch")
        for n, data in enumerate(contents)
    ]
    for n, (f, data) in enumerate(zip(uploaded, contents, strict=True)):
        assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch"
        assert f.filename == f"in-{n}.jsonl" and f.bytes == len(data)

    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == [uploaded[2].id, uploaded[1].id]  # newest first
    assert first.has_more is True
    # The client pages on by itself with after=<last id>, until has_more is false.
    assert [f.id for f in client.files.list(limit=2)] == [f.id for f in reversed(uploaded)]
    assert [f.id for f in client.files.list(order="asc")] == [f.id for f in uploaded]
    assert client.files.list(purpose="batch_output").data == []

    got = client.files.retrieve(uploaded[1].id)
    assert got.model_dump() == uploaded[1].model_dump()
    assert client.files.content(uploaded[2].id).read() == contents[2]

    deleted = client.files.delete(uploaded[0].id)
    assert deleted.deleted is True and deleted.id == uploaded[0].id
    with pytest.raises(openai.NotFoundError) as caught:
        client.files.retrieve(uploaded[0].id)
    assert_openai_error(caught.value, status=404, param="id")
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded[0].id)
    assert [f.id for f in client.files.list()] == [uploaded[2].id, uploaded[1].id]


async def test_upload_and_download_with_the_async_client(
    api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.AsyncOpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    # Larger than one read of the server's parser and with no trailing newline.
    data = batch_file("m", 2000).rstrip(b"\n")
    f = await client.files.create(file=("big.jsonl", data), purpose="batch")
    assert f.bytes == len(data)
    assert await (await client.files.content(f.id)).aread() == data
    page = await client.files.list()
    assert [x.id for x in page.data] == [f.id] and page.has_more is False


async def test_a_file_over_the_size_limit_is_refused_and_not_kept(
    api_server: ApiServer, api_keys: Keys
) -> None:
    client = openai.OpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    too_big = b"x" * ((1 << 20) + 1)  # the session server's limit is 1 MiB
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("big.jsonl", too_big), purpose="batch")
    assert_openai_error(caught.value, status=400, code="file_too_large", param="file")
    assert client.files.list().data == []


async def test_only_purpose_batch_is_taken(api_server: ApiServer, api_keys: Keys) -> None:
    client = openai.OpenAI(
        base_url=api_server.base_url, api_key=await api_keys.new(), max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    assert_openai_error(caught.value, status=400, param="purpose")
    assert client.files.list().data == []


async def test_a_hand_made_multipart_body_with_the_file_first_is_read_whole(
    api_server: ApiServer, api_keys: Keys
) -> None:
    """Another client may send the file before ``purpose`` and name it with a path."""
    key = await api_keys.new()
    data = b"\n".join([b'{"a": 1}'] * 50_000)  # no trailing newline: 50,000 lines
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="C:\\\\dir\\\\in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    body += (
        data
        + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode()
    )
    body += f"batch\r\n--{boundary}--\r\n".encode()
    async with httpx.AsyncClient(base_url=api_server.base_url) as http:
        answer = await http.post(
            "/files",
            content=body,
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": f"multipart/form-data; boundary={boundary}",
            },
        )
        assert answer.status_code == 200, answer.text
        f = answer.json()
        assert (f["filename"], f["bytes"], f["purpose"]) == ("in.jsonl", len(data), "batch")
        got = await http.get(
            f"/files/{f['id']}/content", headers={"Authorization": f"Bearer {key}"}
        )
        assert got.content == data
        broken = await http.post(
            "/files",
            content=b"not multipart",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "text/plain"},
        )
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "file"
