"""A model routed to an endpoint ``--serve-via batch``: an OpenAI client's batch sent to
``llm-batch serve`` (the front) runs as provider batches on the endpoint's Batch API,
which is a second ``llm-batch serve`` (the provider of tests/provider).

The front has a database of its own on the session's Postgres (routes are global to a
database: the provider, on the session's, must not route the model back to itself), and
a CPU worker process of its own on a queue of its own; Temporal and S3 are shared."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Final

import openai
from pydantic import SecretStr
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.api.auth import create_key
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.api_server import ApiServer
from tests.fixtures.postgres_db import fresh_database
from tests.fixtures.worker_processes import cpu_worker_process, stop_worker
from tests.llmbatch.api.helpers import assert_openai_error, jsonl, lines_of, request_line, until
from tests.provider.conftest import Provider, provider_batches
from tests.remote.conftest import add_endpoint, cli

CHAT: Final = "/v1/chat/completions"


async def test_a_batch_for_a_model_routed_via_batch_runs_as_provider_batches_once(
    provider: Provider, temporal_client: Client, pg_dsn: str, tmp_path: Path
) -> None:
    settings, api_server, key, model = provider
    async with fresh_database(pg_dsn, migrate=True) as front_dsn:
        front = settings.model_copy(
            update={
                "postgres_dsn": SecretStr(front_dsn),
                "cpu_task_queue": f"front-{uuid.uuid4().hex[:8]}",
            }
        )
        endpoint = add_endpoint(front, api_server.base_url, "--serve-as", model)
        # Via batch needs the endpoint's Batch API: refused, and nothing changed.
        refused = cli(front, "endpoint", "update", endpoint, "--serve-via", "batch")
        assert refused.returncode != 0
        assert "does not declare a Batch API" in refused.stdout + refused.stderr, refused
        shown = cli(front, "endpoint", "show", endpoint, "--json")
        assert json.loads(shown.stdout)["serves"] == {"generate": [model]}, shown.stdout
        routed = cli(
            front, "endpoint", "update", endpoint, "--batch-api", "--serve-via", "batch",
            "--batch-max-in-flight", "1",
        )  # fmt: skip
        assert routed.returncode == 0, routed.stdout + routed.stderr
        assert f"serves {model} (generate via batch)" in " ".join(routed.stdout.split())
        shown = cli(front, "endpoint", "show", endpoint, "--json")
        assert json.loads(shown.stdout)["serves"] == {"generate via batch": [model]}

        pool = await ledger.db.create_pool(front_dsn, max_size=2)
        server = ApiServer(
            settings=front,
            log=tmp_path / "front.log",
            # Two shards of 4 lines: two provider batches, one at a time.
            env={"LLMBATCH_API_SHARD_SIZE": "4", "LLMBATCH_API_MAX_CONCURRENT_SHARDS": "2"},
        )
        worker = cpu_worker_process(front, tmp_path / "front-cpu.log")
        try:
            await wait_for_pollers(
                temporal_client, [front.cpu_task_queue], procs=[worker], within_s=180
            )
            server.start()
            secret = (await create_key(pool, project="front")).secret
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key=secret, max_retries=0)
            lines = [request_line(model, n) for n in range(8)]
            f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            created = await client.batches.create(
                input_file_id=f.id, endpoint=CHAT, completion_window="24h"
            )
            batch = await until(
                client,
                created.id,
                lambda b: b.status not in ("validating", "in_progress", "finalizing"),
            )
            assert batch.status == "completed", batch
            assert batch.request_counts is not None
            assert batch.request_counts.model_dump() == {"total": 8, "completed": 8, "failed": 0}
            out = await lines_of(client, batch.output_file_id)
            assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
            assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in out)
            spec = await pool.fetchval("SELECT spec FROM jobs WHERE job_id = $1", created.id)
            assert (spec["remote_endpoint"], spec["via"]) == (endpoint, "batch")

            # On the provider: one completed batch per shard of the front's batch.
            batches = await provider_batches(api_server, key, created.id)
            assert sorted(b["metadata"]["shard"] for b in batches) == ["0", "1"]
            assert all(b["status"] == "completed" for b in batches)
            assert sum(b["request_counts"]["total"] for b in batches) == 8

            # A model routed via batch whose endpoint lost its Batch API is refused
            # with the reason, not run online.
            await pool.execute("DELETE FROM endpoint_batch_api WHERE endpoint = $1", endpoint)
            f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            try:
                await client.batches.create(
                    input_file_id=f.id, endpoint=CHAT, completion_window="24h"
                )
                raise AssertionError("a batch via an endpoint without a Batch API was taken")
            except openai.BadRequestError as exc:
                error = assert_openai_error(exc, status=400, param="model")
                assert "does not declare a Batch API" in error["message"], error
        finally:
            server.stop()
            stop_worker(worker)
            await pool.close()
