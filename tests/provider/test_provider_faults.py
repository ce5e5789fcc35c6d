"""More faults of jobs via batch: the CPU worker SIGKILLed while it records a finished
provider batch's answers, and a dead-lettered job re-driven through new provider
batches. The provider is llm-batch's own ``llm-batch serve`` (tests/provider/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

import llmbatch.activities.provider_batch as provider_activities
from llmbatch.client.temporal import start_job
from llmbatch.contract.provider import PROVIDER_COLLECT
from llmbatch.contract.spec import EndpointVia
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.tcp_proxy import TcpProxy
from tests.fixtures.worker_processes import (
    cpu_worker_process,
    job_result,
    signal_group,
    stop_worker,
)
from tests.provider.conftest import Provider, provider_batches, rows_of, wrong_url_on_every_line
from tests.remote.conftest import add_endpoint, cli, job, output_ids

pytestmark = pytest.mark.slow


async def test_the_cpu_worker_killed_while_recording_a_finished_batch_records_each_item_once(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    workers, api_server, key, model = provider
    # The job's workflows and CPU steps on a queue of their own, served by worker
    # processes (SIGKILL-able). The provider is reached through a proxy that holds each
    # request a second (the fault injector): the recording step, which reads the batch
    # and then its files, lasts long enough to be caught running.
    own = workers.model_copy(update={"cpu_task_queue": f"pb-{uuid.uuid4().hex[:8]}"})
    target = api_server.base_url.removeprefix("http://").split("/", 1)[0]
    async with TcpProxy(target, delay_s=1.0) as proxy:
        endpoint = add_endpoint(own, f"http://{proxy.address}/v1", "--batch-api")
        rows = rows_of(8)
        spec = job(tmp_path, endpoint=endpoint, model=model, rows=rows, shard_size=8)
        spec = spec.model_copy(update={"id_field": "id", "via": EndpointVia.BATCH})
        first = cpu_worker_process(own, tmp_path / "cpu-1.log")
        try:
            await wait_for_pollers(
                temporal_client, [own.cpu_task_queue], procs=[first], within_s=180
            )
            handle, _ = await start_job(temporal_client, spec, settings=own)
            child = temporal_client.get_workflow_handle(f"{spec.job_id}/shard-00000/provider-batch")
            caught = False
            for _ in range(6000):
                pending: Sequence[Any]
                try:
                    pending = (await child.describe()).raw_description.pending_activities
                except Exception:  # the child is not started yet
                    pending = []
                if any(
                    a.activity_type.name == PROVIDER_COLLECT
                    and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                    for a in pending
                ):
                    signal_group(first, signal.SIGKILL)  # while it records the answers
                    caught = True
                    break
                await asyncio.sleep(0.1)
            assert caught, "the recording step was never seen running"
            first.wait(30)
        finally:
            stop_worker(first)
        recorded_at_kill = await api_pool.fetchval(
            "SELECT count(*) FROM items WHERE job_id = $1 AND status = 'succeeded'", spec.job_id
        )
        second = cpu_worker_process(own, tmp_path / "cpu-2.log")
        try:
            summary = await asyncio.wait_for(job_result(handle), 600)
        finally:
            stop_worker(second)

    assert 0 <= recorded_at_kill <= 8
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (8, 8, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    assert len(batches) == 1 and batches[0]["status"] == "completed"
    recorded = await api_pool.fetch(
        "SELECT batch_id, collected FROM provider_batches WHERE job_id = $1", spec.job_id
    )
    assert [(r["batch_id"], r["collected"]) for r in recorded] == [(batches[0]["id"], True)]


async def test_a_redrive_of_a_job_via_batch_sends_new_provider_batches_and_answers_once(
    provider: Provider,
    temporal_client: Client,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, api_server, key, model = provider
    # The first run's batch is refused by the provider (its lines are dead-lettered);
    # the fault is gone for the re-drive.
    real_line = provider_activities.request_line
    monkeypatch.setattr(provider_activities, "request_line", wrong_url_on_every_line)
    endpoint = add_endpoint(settings, api_server.base_url, "--batch-api")
    rows = rows_of(6)
    spec = job(tmp_path, endpoint=endpoint, model=model, rows=rows, shard_size=6)
    spec = spec.model_copy(update={"id_field": "id", "via": EndpointVia.BATCH})
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 300)
    assert (summary.items_succeeded, summary.items_dead) == (0, 6)
    # (Not monkeypatch.undo(): that would also take the provider's key from the env.)
    monkeypatch.setattr(provider_activities, "request_line", real_line)

    done = await asyncio.to_thread(cli, settings, "dlq", "redrive", spec.job_id, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert (result["requeued"], result["succeeded"], result["dead"]) == (6, 6, 0)

    states = await api_pool.fetch(
        "SELECT status, count(*) AS n FROM items WHERE job_id = $1 GROUP BY status", spec.job_id
    )
    assert {r["status"]: r["n"] for r in states} == {"succeeded": 6}
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    # The first run's (refused) batch and the re-drive's own, with another token.
    assert sorted(b["status"] for b in batches) == ["completed", "failed"]
    tokens = await api_pool.fetch(
        "SELECT token, status FROM provider_batches WHERE job_id = $1 ORDER BY created_at",
        spec.job_id,
    )
    assert [t["status"] for t in tokens] == ["failed", "completed"]
    assert len({t["token"] for t in tokens}) == 2
