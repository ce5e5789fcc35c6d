"""/v1/embeddings batches through the official client on a real ``llm-batch serve``,
served by a real embedding worker (tests/fixtures/embed_worker.py): the output file
holds OpenAI's embedding lists, built from the staged vectors, in the input's order.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Final

import pytest
from openai.types import CreateEmbeddingResponse
from transformers import AutoTokenizer

from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.embed_worker import DIM, EmbedWorker
from tests.llmbatch.api.helpers import jsonl, lines_of, new_client, until

pytestmark = pytest.mark.slow

EMBEDDINGS: Final = "/v1/embeddings"
TEXTS = ["A dog ran along the sea.", "Tax law changed this year.", "Bread rises in the oven."]


def close(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b, strict=True))


async def test_an_embeddings_batch_answers_each_request_with_openais_embedding_list(
    embed_worker: EmbedWorker, api_server: ApiServer, api_keys: Keys
) -> None:
    client, _ = await new_client(api_server, api_keys)
    model = embed_worker.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    bodies: dict[str, dict[str, Any]] = {
        "floats": {"input": TEXTS[0]},
        "base64": {"input": TEXTS, "encoding_format": "base64"},
        "short": {"input": TEXTS[1], "dimensions": 32},
        # Token-id input, as OpenAI and vLLM take it: the text's own ids give its vector.
        "tokens": {"input": tokenizer.encode(TEXTS[0])},
        "empty": {"input": ""},  # refused when the request is built: it alone fails
        "again": {"input": TEXTS[0], "encoding_format": "float"},
    }
    lines = [
        {"custom_id": cid, "method": "POST", "url": EMBEDDINGS, "body": {"model": model, **body}}
        for cid, body in bodies.items()
    ]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = await client.batches.create(
        input_file_id=f.id, endpoint=EMBEDDINGS, completion_window="24h"
    )
    assert created.endpoint == EMBEDDINGS and created.model == model

    batch = await until(
        client, created.id, lambda b: b.status not in ("validating", "in_progress", "finalizing")
    )
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.usage is not None
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens == 0

    out = await lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["floats", "base64", "short", "tokens", "again"]
    bodies_out = {}
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "list" and body["model"] == model
        assert body["usage"]["prompt_tokens"] > 0
        if line["custom_id"] != "base64":
            # The official client's own type reads a float body as /v1/embeddings'
            # (the client decodes base64 itself before it builds that type).
            CreateEmbeddingResponse.model_validate(body)
        bodies_out[line["custom_id"]] = body

    one = bodies_out["floats"]["data"]
    assert [d["index"] for d in one] == [0]
    vector = one[0]["embedding"]
    assert len(vector) == DIM and math.isclose(math.hypot(*vector), 1.0, rel_tol=1e-4)
    # The base64 line's vectors are the same float32s; its first text is the same text.
    many = bodies_out["base64"]["data"]
    assert [d["index"] for d in many] == [0, 1, 2]
    decoded = [list(memoryview(base64.b64decode(d["embedding"])).cast("f")) for d in many]
    assert all(len(v) == DIM for v in decoded) and close(decoded[0], vector)
    assert not close(decoded[1], vector)
    assert len(bodies_out["short"]["data"][0]["embedding"]) == 32
    assert close(bodies_out["again"]["data"][0]["embedding"], vector)
    assert close(bodies_out["tokens"]["data"][0]["embedding"], vector)

    (error,) = await lines_of(client, batch.error_file_id)
    # A 400, as OpenAI reports a body error; the error field keeps llm-batch's class.
    assert error["custom_id"] == "empty" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "InvalidRequest"
