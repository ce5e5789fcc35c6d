"""Completions and embeddings through ``llm-batch worker remote``, end to end: a
``/v1/completions`` batch from the official ``openai`` client for a model routed to an
endpoint reaches the endpoint as ``/completions`` (never as chat), and an embed job on
an endpoint in front of a second vLLM server, a pooling one, is embedded by a remote
worker started with ``--task embed``, every row once with the model's vectors."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ApiEndpoint, JobSpec, Task
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.embed_worker import DIM, HF_OVERRIDES
from tests.fixtures.openai_server import (
    CANARY_KEY,
    Gateway,
    OpenAIServer,
    remote_worker_process,
    running_openai_server,
)
from tests.fixtures.worker_processes import job_result, stop_worker
from tests.llmbatch.api.helpers import jsonl, new_client, request_line
from tests.remote.conftest import KEY_ENV, add_endpoint, batch_on_endpoint, cli


def written(manifest_uri: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job's manifest (written to a local folder) and the rows of its output parts."""
    found = json.loads(Path(manifest_uri.removeprefix("file://")).read_text())
    rows = [
        json.loads(line)
        for part in found["output_parts"]
        for line in Path(part.removeprefix("file://")).read_text().splitlines()
    ]
    return found, rows


@pytest.fixture(scope="module")
def embed_server(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    """vLLM's server running the tiny model as an embedding (pooling) model, with the
    same overrides as the in-process embedding worker, for this module."""
    folder = tmp_path_factory.mktemp("embed-server")
    args = ("--runner", "pooling", "--convert", "embed", "--hf-overrides", HF_OVERRIDES)
    with running_openai_server(tiny_model_path, folder, *args) as server:
        yield server


async def test_a_completions_batch_reaches_the_endpoint_as_completions_once_each(
    cpu_only: Settings,
    temporal_client: Client,
    openai_server: OpenAIServer,
    gateway: Gateway,
    api_server: ApiServer,
    api_keys: Keys,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> None:
    settings = cpu_only
    model = openai_server.model
    endpoint = add_endpoint(settings, gateway.base_url, "--serve-as", model)
    try:
        client, _ = await new_client(api_server, api_keys)
        lines = [request_line(model, n, endpoint=ApiEndpoint.COMPLETIONS) for n in range(6)]
        f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        created = await client.batches.create(
            input_file_id=f.id, endpoint=ApiEndpoint.COMPLETIONS.value, completion_window="24h"
        )
        out = await batch_on_endpoint(
            client, created.id, lines, settings=settings, temporal_client=temporal_client,
            endpoint=endpoint, model=model, log=tmp_path / "w.log",
        )  # fmt: skip
        for line in out:
            body = line["response"]["body"]
            assert body["object"] == "text_completion", body
            assert isinstance(body["choices"][0]["text"], str)
        # Sent as completions, each once; nothing went to the chat path.
        sent = gateway.requests("/v1/completions")
        assert len(sent) == 6 and {s for _, s in sent} == {200}
        assert gateway.requests("/chat/completions") == []
    finally:
        removed = await asyncio.to_thread(cli, settings, "endpoint", "remove", endpoint)
        assert removed.returncode == 0, removed.stderr


async def test_an_embed_job_on_an_endpoint_embeds_every_row_once_with_the_models_vectors(
    cpu_only: Settings,
    temporal_client: Client,
    embed_server: OpenAIServer,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> None:
    settings = cpu_only
    model = embed_server.model
    gateway = Gateway(tmp_path / "gateway", embed_server.port, CANARY_KEY).start()
    endpoint = add_endpoint(settings, gateway.base_url)
    worker = remote_worker_process(
        settings, endpoint, tmp_path / "w.log", "--task", "embed", env={KEY_ENV: CANARY_KEY}
    )
    try:
        await wait_for_pollers(
            temporal_client,
            [settings.gpu_task_queue(model, Task.EMBED, endpoint=endpoint)],
            procs=[worker],
            within_s=180,
        )
        rows = [{"id": f"r{i:03d}", "body": f"body text number {i}"} for i in range(30)]
        source = tmp_path / "rows.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        spec = JobSpec.model_validate(
            {
                "job_id": f"embed-remote-{uuid.uuid4().hex[:8]}",
                "task": Task.EMBED,
                "inputs": [str(source)],
                "text": "{{ body }}",
                "id_field": "id",
                "model": model,
                "remote_endpoint": endpoint,
                "shard_size": 10,
                "output_uri": f"file://{tmp_path / 'out'}",
            }
        )
        handle, _ = await start_job(temporal_client, spec, settings=settings)
        summary = await asyncio.wait_for(job_result(handle), 300)
        assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (30, 30, 0)

        found, out = written(summary.manifest)
        assert found["embeddings"] == {"count": 30, "dimensions": DIM}
        ids = [r["item_id"] for r in out]
        assert sorted(ids) == [r["id"] for r in rows]  # each once
        vectors: dict[str, Any] = {r["item_id"]: r["embedding"] for r in out}
        for vector in vectors.values():
            assert len(vector) == DIM
            assert abs(math.sqrt(sum(x * x for x in vector)) - 1.0) < 1e-3  # vLLM normalizes
        assert len({tuple(v) for v in vectors.values()}) == 30  # each row its own text

        # Through the endpoint's gateway, as embeddings; nothing generated.
        sent = gateway.requests("/embeddings")
        assert sent and {s for _, s in sent} == {200}
        assert gateway.requests("/completions") == []
        usage = await pool.fetchval(
            "SELECT sum(requests) FROM endpoint_usage WHERE job_id = $1 AND endpoint = $2",
            spec.job_id,
            endpoint,
        )
        assert usage == len(sent)
    finally:
        stop_worker(worker)
        gateway.stop()
        await asyncio.to_thread(cli, settings, "endpoint", "remove", endpoint)
