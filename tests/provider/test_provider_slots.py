"""An endpoint's ``--batch-max-in-flight`` slot held by a shard workflow that was
terminated (it runs no code, so never gives the slot back): the shard waiting for the
slot frees it and runs. The provider is llm-batch's own ``llm-batch serve``
(tests/provider/conftest.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from llmbatch.client.temporal import start_job
from llmbatch.contract.names import shard_workflow_id
from llmbatch.contract.spec import EndpointVia, JobSpec
from llmbatch.provider import slots
from tests.fixtures.worker_processes import job_result
from tests.provider.conftest import Provider, provider_batches, rows_of
from tests.remote.conftest import add_endpoint, job, output_ids


async def _until(pool: asyncpg.Pool, query: str, *args: Any, what: str) -> Any:
    """The first non-null value of ``query``, polled (the session's workers run in this
    event loop: the wait must not block it)."""
    for _ in range(1500):
        value = await pool.fetchval(query, *args)
        if value is not None:
            return value
        await asyncio.sleep(0.2)
    raise TimeoutError(what)


async def test_a_slot_held_by_a_terminated_shard_goes_to_the_shard_waiting_for_it(
    provider: Provider,
    temporal_client: Client,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, api_server, key, model = provider
    endpoint = add_endpoint(
        settings, api_server.base_url, "--batch-api", "--batch-max-in-flight", "1"
    )

    def via_batch(rows: list[dict[str, Any]], prefix: str) -> JobSpec:
        spec = job(
            tmp_path, endpoint=endpoint, model=model, rows=rows, shard_size=len(rows), prefix=prefix
        )
        return spec.model_copy(update={"id_field": "id", "via": EndpointVia.BATCH})

    # 100 requests: the provider runs them a few at a time, so the batch is still
    # running when its shard is terminated and found.
    held = via_batch(rows_of(100), "held")
    held_handle, _ = await start_job(temporal_client, held, settings=settings)
    orphan = await _until(
        api_pool,
        "SELECT batch_id FROM provider_batches WHERE job_id = $1",
        held.job_id,
        what="the first job's provider batch",
    )
    rows = [{"id": f"w{i}", "text": f"Say something about {i}."} for i in range(6)]
    waiting = via_batch(rows, "waiting")
    handle, _ = await start_job(temporal_client, waiting, settings=settings)
    try:
        await _until(
            api_pool,
            "SELECT token FROM provider_batch_slots WHERE job_id = $1 AND slot IS NULL",
            waiting.job_id,
            what="the second job's shard waiting for the slot",
        )
        shard = temporal_client.get_workflow_handle(shard_workflow_id(held.job_id, 0))
        await shard.terminate(reason="test: a shard terminated while it holds a slot")
        # Its provider-batch child goes with it (the parent close policy), soon after.
        child = temporal_client.get_workflow_handle(f"{shard.id}/provider-batch")
        for _ in range(300):
            if (await child.describe()).status != WorkflowExecutionStatus.RUNNING:
                break
            await asyncio.sleep(0.2)
        assert (await child.describe()).status == WorkflowExecutionStatus.TERMINATED
        # No code of the terminated workflows ran: the slot is still theirs.
        assert (
            await api_pool.fetchval(
                "SELECT slot FROM provider_batch_slots WHERE job_id = $1", held.job_id
            )
            == 0
        )
        # From here on a holder is described every second, not every 30 s (the CPU
        # worker runs in this process), so the terminated shard's batch is found while
        # it still runs at the provider.
        monkeypatch.setattr(slots, "CHECK_EVERY", timedelta(seconds=1))

        summary = await asyncio.wait_for(job_result(handle), 300)
    finally:
        # The first job waits for a shard that will never report.
        await held_handle.terminate(reason="test: done")

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (6, 6, 0)
    assert sorted(output_ids(tmp_path, waiting.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, waiting.job_id)
    assert len(batches) == 1 and batches[0]["status"] == "completed"
    # The terminated shard's batch, which nobody would read, was cancelled; no second
    # one was made for it.
    orphans = await provider_batches(api_server, key, held.job_id)
    assert [b["id"] for b in orphans] == [orphan]
    assert orphans[0]["status"] in ("cancelling", "cancelled"), orphans[0]
    left = await api_pool.fetchval(
        "SELECT count(*) FROM provider_batch_slots WHERE endpoint = $1", endpoint
    )
    assert left == 0
