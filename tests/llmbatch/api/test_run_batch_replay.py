"""vLLM's own ``run_batch`` test inputs (tests/entrypoints/openai/test_run_batch.py in
vLLM: its chat, embeddings and invalid files), run through ``run_batch`` and through
``llm-batch serve`` with the tiny model: every line vLLM answers, llm-batch answers too
(the same vectors, for embeddings).

llm-batch is as strict as OpenAI's Batch API about the file: a line for another model
or URL fails validation (run_batch answers it per line), so the chat file runs once as
given (refused, naming those lines) and once without them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.embed_worker import HF_OVERRIDES, EmbedWorker
from tests.fixtures.model import MAX_MODEL_LEN
from tests.llmbatch.api.helpers import jsonl, lines_of, new_client, submit

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
# vLLM's test names its model; the lines here name the session's tiny model instead.
THEIR_MODEL = "hmellor/tiny-random-LlamaForCausalLM"


def chat(custom_id: str, system: str, *, model: str = THEIR_MODEL, **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Hello world!"},
        ],
        "max_tokens": 1000,
    }
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {**body, **extra}}


# vLLM's INPUT_BATCH, line for line.
INPUT_BATCH = [
    chat("request-1", "You are a helpful assistant."),
    chat("request-2", "You are an unhelpful assistant."),
    chat("request-3", "You are an unhelpful assistant.", model="NonExistModel"),
    {**chat("request-4", "You are an unhelpful assistant."), "url": "/bad_url"},
    chat("request-5", "You are an unhelpful assistant.", stream="True"),
]


def embedding(custom_id: str, text: str, *, model: str = "their-embedder") -> dict[str, Any]:
    body = {"model": model, "input": text}
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS, "body": body}


EMBEDDINGS = "/v1/embeddings"
# vLLM's INPUT_EMBEDDING_BATCH, line for line.
INPUT_EMBEDDING_BATCH = [
    embedding("request-1", "You are a helpful assistant."),
    embedding("request-2", "You are an unhelpful assistant."),
    embedding("request-3", "Hello world!"),
    embedding("request-4", "Hello world!", model="NonExistModel"),
]
# vLLM's INVALID_INPUT_BATCH: its first line has no custom_id.
INVALID_INPUT_BATCH = [
    {
        "invalid_field": "request-1",
        **{k: v for k, v in chat("x", "You are a helpful assistant.").items() if k != "custom_id"},
    },
    chat("request-2", "You are an unhelpful assistant."),
]


def named(lines: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        body = dict(line["body"])
        if body.get("model") in (THEIR_MODEL, "their-embedder"):
            body["model"] = model
        out.append({**line, "body": body})
    return out


def run_batch(
    model: str, lines: list[dict[str, Any]], work: Path, *args: str
) -> tuple[int, list[Any]]:
    """vLLM's run_batch on ``lines`` (``args``: more engine arguments): its exit code and
    output lines."""
    src, dst = work / "in.jsonl", work / "out.jsonl"
    src.write_bytes(jsonl(lines))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o",
         str(dst), "--model", model, "--dtype", "float32", "--max-model-len",
         str(MAX_MODEL_LEN), "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20),
         *args],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0 or not dst.exists():
        return proc.returncode, []
    return proc.returncode, [json.loads(x) for x in dst.read_text().splitlines() if x.strip()]


async def test_vllms_run_batch_inputs_are_answered_by_llm_batch_too(
    served_model: str, model_name: str, api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = named(INPUT_BATCH, served_model)
    code, theirs = run_batch(model_name, lines, tmp_path, "--served-model-name", served_model)
    assert code == 0 and [x["custom_id"] for x in theirs] == [x["custom_id"] for x in lines]
    answered = {x["custom_id"] for x in theirs if x["error"] is None}
    # Its max_tokens of 1000 is more than the tiny model's context of 512 leaves:
    # run_batch refuses those lines (400), llm-batch generates up to the context's end.
    refused_for_length = {
        x["custom_id"] for x in theirs if x["error"] and "max_tokens" in json.dumps(x["error"])
    }

    # As given: refused as OpenAI refuses it, naming the lines for another model and URL.
    failed = await submit(client, lines)
    assert failed.status == "failed" and failed.errors is not None
    assert {(e.line, e.code) for e in failed.errors.data or []} == {
        (3, "model_mismatch"),
        (4, "url_mismatch"),
    }

    # Without them: every line run_batch answered is answered here too, and the stream
    # line is an error in both.
    runnable = [x for x in lines if x["custom_id"] not in ("request-3", "request-4")]
    batch = await submit(client, runnable)
    assert batch.status == "completed", batch
    out = {x["custom_id"]: x for x in await lines_of(client, batch.output_file_id)}
    errors = {x["custom_id"] for x in await lines_of(client, batch.error_file_id)}
    assert answered - {"request-3", "request-4"} <= set(out)
    # (request-5 streams: run_batch's max_tokens check happens to come first.)
    assert refused_for_length - {"request-3", "request-4", "request-5"} <= set(out)
    assert {"request-1", "request-2"} <= set(out)
    for custom_id in ("request-1", "request-2"):
        (choice,) = out[custom_id]["response"]["body"]["choices"]
        assert choice["finish_reason"] in ("stop", "length")
    assert "request-5" in errors and "request-5" not in answered


async def test_vllms_invalid_run_batch_input_is_refused_by_both(
    served_model: str, model_name: str, api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    client, _ = await new_client(api_server, api_keys)
    lines = named(INVALID_INPUT_BATCH, served_model)
    code, _ = run_batch(model_name, lines, tmp_path, "--served-model-name", served_model)
    assert code != 0
    failed = await submit(client, lines)
    assert failed.status == "failed" and failed.errors is not None
    assert [(e.line, e.code) for e in failed.errors.data or []] == [
        (1, "missing_required_parameter")
    ]


async def test_vllms_run_batch_embeddings_are_the_same_vectors_here(
    embed_worker: EmbedWorker, api_server: ApiServer, api_keys: Keys, tmp_path: Path
) -> None:
    client, _ = await new_client(api_server, api_keys)
    model = embed_worker.model
    lines = named(INPUT_EMBEDDING_BATCH, model)
    code, theirs = run_batch(
        model, lines, tmp_path, "--runner", "pooling", "--convert", "embed",
        "--hf-overrides", HF_OVERRIDES,
    )  # fmt: skip
    assert code == 0
    vectors = {
        x["custom_id"]: x["response"]["body"]["data"][0]["embedding"]
        for x in theirs
        if x["error"] is None
    }
    assert {"request-1", "request-2", "request-3"} <= set(vectors), theirs

    failed = await submit(client, lines, EMBEDDINGS)
    assert failed.status == "failed" and failed.errors is not None
    assert [(e.line, e.code) for e in failed.errors.data or []] == [(4, "model_mismatch")]

    batch = await submit(client, lines[:3], EMBEDDINGS)
    assert batch.status == "completed", batch
    ours = {
        x["custom_id"]: x["response"]["body"]["data"][0]["embedding"]
        for x in await lines_of(client, batch.output_file_id)
    }
    assert set(ours) == {"request-1", "request-2", "request-3"}
    for custom_id, vector in ours.items():
        assert len(vector) == len(vectors[custom_id])
        assert all(
            math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
            for a, b in zip(vector, vectors[custom_id], strict=True)
        ), custom_id
