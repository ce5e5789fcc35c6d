"""Jobs handed to a provider's Batch API: the provider is a real one, llm-batch's own
``llm-batch serve`` on the test stack (its own project and key; its batches run on the
session's GPU worker), and the job's shards go to it as provider batches, waited for by
the session's CPU worker."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from temporalio.client import Client

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import EndpointVia, SamplingSpec
from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.worker_processes import job_result
from tests.remote.conftest import KEY_ENV, add_endpoint, cli, job, output_ids


async def _provider_batches(server: ApiServer, key: str, job_id: str) -> list[dict[str, Any]]:
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


async def test_job_via_batch_runs_once_with_one_provider_batch_per_shard(
    workers: Settings,
    temporal_client: Client,
    api_server: ApiServer,
    api_keys: Keys,
    api_pool: asyncpg.Pool,
    served_model: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = workers
    key = await api_keys.new(f"provider-{uuid.uuid4().hex[:6]}")
    # The CPU worker (this process) reads the key from its environment, as a deployment's does.
    monkeypatch.setenv(KEY_ENV, key)
    endpoint = add_endpoint(
        settings, api_server.base_url, "--input-price", "2", "--output-price", "8",
        "--batch-api", "--batch-input-price", "1", "--batch-output-price", "4",
    )  # fmt: skip
    shown = cli(settings, "endpoint", "show", endpoint)
    assert shown.returncode == 0 and "Batch API: $1/$4 per 1M tokens" in shown.stdout, shown.stdout
    # Two shards of 12; rows 10 and 11 repeat rows 0 and 1 (greedy): deduplicated, so
    # shard 0 sends 10 requests, shard 1 sends 12.
    rows = [{"id": f"r{i}", "text": f"Say something about {i % 10 if i in (10, 11) else i}."}
            for i in range(24)]  # fmt: skip
    spec = job(tmp_path, endpoint=endpoint, model=served_model, rows=rows, shard_size=12)
    spec = spec.model_copy(
        update={
            "id_field": "id",
            "via": EndpointVia.BATCH,
            "sampling": SamplingSpec(max_tokens=4, temperature=0.0),
        }
    )
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 300)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (24, 24, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await _provider_batches(api_server, key, spec.job_id)
    assert sorted(b["metadata"]["shard"] for b in batches) == ["0", "1"]
    assert all(b["status"] == "completed" for b in batches)
    sent = {b["metadata"]["shard"]: b["request_counts"]["total"] for b in batches}
    assert sent == {"0": 10, "1": 12}
    ledger_rows = await api_pool.fetch(
        "SELECT item_id, result_source, shared_with FROM items WHERE job_id = $1 "
        "AND result_source <> 'generated' ORDER BY item_id",
        spec.job_id,
    )
    assert [(r["item_id"], r["shared_with"]) for r in ledger_rows] == [("r10", "r0"), ("r11", "r1")]
    recorded = await api_pool.fetch(
        "SELECT batch_id, status, collected, prompt_tokens, completion_tokens "
        "FROM provider_batches WHERE job_id = $1 ORDER BY shard",
        spec.job_id,
    )
    assert sorted(r["batch_id"] for r in recorded) == sorted(b["id"] for b in batches)
    assert all(r["collected"] and r["status"] == "completed" for r in recorded)
    status = cli(settings, "status", spec.job_id)
    assert status.returncode == 0, status.stderr
    prompt = sum(r["prompt_tokens"] for r in recorded)
    completion = sum(r["completion_tokens"] for r in recorded)
    assert prompt > 0 and completion > 0
    batch_cost = (prompt * 1 + completion * 4) / 1e6
    assert f"${batch_cost:.4f} at batch prices" in status.stdout, status.stdout
    assert f"(online: ${2 * batch_cost:.4f})" in status.stdout, status.stdout
    assert "completed, 10 completed, 0 failed of 10, recorded" in status.stdout, status.stdout
