"""A batch's error file names each failed request by its line number and ``custom_id``,
never by the address of the object its input file is stored in (the API's files are
internal objects). Through the official client on a real ``llm-batch serve``, the
session's workers and engine."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.api_server import ApiServer, Keys
from tests.llmbatch.api.helpers import new_client, request_line, submit

pytestmark = pytest.mark.slow


async def test_a_failed_lines_message_names_its_line_number_and_no_object_address(
    served_model: str, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = [request_line(served_model, n) for n in range(6)]
    # Refused when its request is built (render), and by vLLM's request model in the
    # engine worker (top_logprobs without logprobs): both die with their source.
    lines[5]["body"]["stream"] = True
    lines[2]["body"]["top_logprobs"] = 2
    batch = await submit(client, lines)
    assert batch.status == "completed", batch
    assert batch.error_file_id is not None
    data = await (await client.files.content(batch.error_file_id)).aread()
    for address in (b"s3://", b"file://", b"/api/files/", api_server.settings.s3_bucket.encode()):
        assert address not in data, data
    errors = {x["custom_id"]: x for x in map(json.loads, data.splitlines())}
    assert set(errors) == {"req-2", "req-5"}
    for custom_id, number in (("req-2", 3), ("req-5", 6)):
        line = errors[custom_id]
        assert line["response"]["status_code"] == 400, line
        for message in (line["error"]["message"], line["response"]["body"]["error"]["message"]):
            assert message.endswith(f"(line {number})"), message
