"""Jobs handed to a provider's Batch API: the provider is a real one, llm-batch's own
``llm-batch serve`` on the test stack (its own project and key; its batches run on the
session's GPU worker), and the job's shards go to it as provider batches, waited for by
the session's CPU worker."""

from __future__ import annotations

import asyncio
import itertools
import signal
import uuid
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import CancelledError

import llmbatch.activities.provider_batch as provider_activities
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import EndpointVia, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from llmbatch.provider.client import TOKEN_KEY, BatchClient
from tests.fixtures.worker_processes import (
    cpu_worker_process,
    job_result,
    signal_group,
    stop_worker,
)
from tests.provider.conftest import Provider, provider_batches, rows_of, wrong_url_on_every_line
from tests.remote.conftest import add_endpoint, cli, job, output_ids

pytestmark = pytest.mark.slow


async def test_job_via_batch_runs_once_with_one_provider_batch_per_shard(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings, api_server, key, served_model = provider
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
    batches = await provider_batches(api_server, key, spec.job_id)
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
    # The provider's answers went to the result cache, as the endpoint's online ones do.
    cached = await api_pool.fetchval(
        "SELECT count(*) FROM result_cache WHERE job_id = $1", spec.job_id
    )
    assert cached == 22
    status = cli(settings, "status", spec.job_id)
    assert status.returncode == 0, status.stderr
    prompt = sum(r["prompt_tokens"] for r in recorded)
    completion = sum(r["completion_tokens"] for r in recorded)
    assert prompt > 0 and completion > 0
    batch_cost = (prompt * 1 + completion * 4) / 1e6
    assert f"${batch_cost:.4f} at batch prices" in status.stdout, status.stdout
    assert f"(online: ${2 * batch_cost:.4f})" in status.stdout, status.stdout
    assert "completed, 10 completed, 0 failed of 10, recorded" in status.stdout, status.stdout


async def _recorded_batch_id(pool: asyncpg.Pool, job_id: str) -> str:
    """The job's (one) provider batch id, once the ledger has it."""
    for _ in range(900):
        batch_id = await pool.fetchval(
            "SELECT batch_id FROM provider_batches WHERE job_id = $1", job_id
        )
        if batch_id is not None:
            return str(batch_id)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"job {job_id}: no provider batch recorded")


def _via_batch(
    provider: Provider,
    tmp_path: Path,
    rows: list[dict[str, Any]],
    *,
    shard_size: int,
    settings: Settings | None = None,
    options: tuple[str, ...] = (),
) -> JobSpec:
    """A job of ``rows`` (keyed by their ``id``) handed to the provider's Batch API, on
    a new endpoint declared with ``--batch-api`` and ``options``."""
    _, api_server, _, served_model = provider
    endpoint = add_endpoint(
        settings or provider.settings, api_server.base_url, "--batch-api", *options
    )
    spec = job(tmp_path, endpoint=endpoint, model=served_model, rows=rows, shard_size=shard_size)
    return spec.model_copy(update={"id_field": "id", "via": EndpointVia.BATCH})


class DiesAfterCreate(BatchClient):
    """Test double (a fault injector, not a fake provider): creates the batch on the real
    provider, then fails the activity before its id is recorded, once per token, as a
    CPU worker killed at that instant would leave it. Temporal retries the step."""

    died: ClassVar[set[str]] = set()

    async def create(
        self, *, input_file_id: str, url: str, window: str, metadata: dict[str, str]
    ) -> dict[str, Any]:
        batch = await super().create(
            input_file_id=input_file_id, url=url, window=window, metadata=metadata
        )
        token = metadata[TOKEN_KEY]
        if token not in DiesAfterCreate.died:
            DiesAfterCreate.died.add(token)
            raise RuntimeError("test double: the worker died between create and record")
        return batch


async def test_a_crash_between_create_and_record_finds_the_batch_it_created(
    provider: Provider,
    temporal_client: Client,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU worker runs in this process: its submit steps use the fault injector.
    monkeypatch.setattr(provider_activities, "BatchClient", DiesAfterCreate)
    settings, api_server, key, _ = provider
    rows = rows_of(16)
    spec = _via_batch(provider, tmp_path, rows, shard_size=8)
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 300)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (16, 16, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    # Each shard's submit died once right after its create: still one batch a shard.
    assert sorted(b["metadata"]["shard"] for b in batches) == ["0", "1"]
    assert {b["metadata"][TOKEN_KEY] for b in batches} <= DiesAfterCreate.died
    recorded = await api_pool.fetch(
        "SELECT batch_id FROM provider_batches WHERE job_id = $1", spec.job_id
    )
    assert sorted(r["batch_id"] for r in recorded) == sorted(b["id"] for b in batches)


async def test_an_expired_batch_is_submitted_again_then_its_rest_dead_letters_as_expired(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings, api_server, key, _ = provider
    # A 2-second window: the provider (2-row shards, one at a time) cannot finish 12
    # requests in it, so every submission expires with some requests left.
    rows = rows_of(12)
    spec = _via_batch(
        provider,
        tmp_path,
        rows,
        shard_size=12,
        options=("--batch-window", "2s"),
    )
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 300)

    # Every item exactly once: answered by one of the submissions, or dead as expired.
    assert summary.items_succeeded + summary.items_dead == 12
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    dead = await api_pool.fetch(
        "SELECT error_class FROM items WHERE job_id = $1 AND status = 'dead'", spec.job_id
    )
    assert {d["error_class"] for d in dead} <= {"BatchExpired"}
    batches = await provider_batches(api_server, key, spec.job_id)
    recorded = await api_pool.fetch(
        "SELECT batch_id, status, submission FROM provider_batches WHERE job_id = $1 "
        "AND batch_id IS NOT NULL ORDER BY submission",
        spec.job_id,
    )
    # One provider batch per submission, the first expired, at most three.
    assert sorted(b["id"] for b in batches) == sorted(r["batch_id"] for r in recorded)
    assert 1 <= len(recorded) <= 3 and recorded[0]["status"] == "expired"
    assert [r["submission"] for r in recorded] == list(range(len(recorded)))
    if summary.items_dead:
        assert len(recorded) == 3 and all(r["status"] == "expired" for r in recorded)


class CreatesThenWaits(BatchClient):
    """Test double (a fault injector, not a fake provider): creates the batch on the real
    provider, then holds the submit step until the test lets it go, so that the job is
    cancelled while the step is in flight, with the batch created."""

    let_go: ClassVar[asyncio.Event | None] = None

    async def create(
        self, *, input_file_id: str, url: str, window: str, metadata: dict[str, str]
    ) -> dict[str, Any]:
        batch = await super().create(
            input_file_id=input_file_id, url=url, window=window, metadata=metadata
        )
        assert CreatesThenWaits.let_go is not None
        await asyncio.wait_for(CreatesThenWaits.let_go.wait(), 120)
        return batch


async def test_a_job_cancelled_while_its_batch_is_submitted_cancels_the_batch(
    provider: Provider,
    temporal_client: Client,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU worker runs in this process: its submit step uses the fault injector.
    CreatesThenWaits.let_go = asyncio.Event()
    monkeypatch.setattr(provider_activities, "BatchClient", CreatesThenWaits)
    settings, api_server, key, _ = provider
    # 40 requests, which the provider runs 2 at a time: still running when cancelled.
    spec = _via_batch(provider, tmp_path, rows_of(40), shard_size=40)
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    for _ in range(600):
        if batches := await provider_batches(api_server, key, spec.job_id):
            break
        await asyncio.sleep(0.2)
    assert len(batches) == 1
    done = await asyncio.to_thread(cli, settings, "cancel", spec.job_id)
    assert done.returncode == 0, done.stderr
    # The cancel reaches the batch's workflow while its submit step is still held.
    child = temporal_client.get_workflow_handle(f"{spec.job_id}/shard-00000/provider-batch")
    for _ in range(600):
        history = await child.fetch_history()
        if any(
            e.HasField("workflow_execution_cancel_requested_event_attributes")
            for e in history.events
        ):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the cancel never reached the provider batch's workflow")
    CreatesThenWaits.let_go.set()
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert isinstance(failure.value.cause, CancelledError)
    for _ in range(600):
        if (await child.describe()).status != WorkflowExecutionStatus.RUNNING:
            break
        await asyncio.sleep(0.2)
    assert (await child.describe()).status == WorkflowExecutionStatus.CANCELED

    (batch,) = await provider_batches(api_server, key, spec.job_id)
    assert batch["status"] in ("cancelling", "cancelled")
    running = await api_pool.fetchval(
        "SELECT count(*) FROM items WHERE job_id = $1 AND status = 'running'", spec.job_id
    )
    assert running == 0


async def test_cancelling_the_job_cancels_its_provider_batch(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings, api_server, key, _ = provider
    # 40 requests: the provider runs them 2 at a time, one shard after another, so the
    # batch is still running when the cancel comes.
    spec = _via_batch(provider, tmp_path, rows_of(40), shard_size=40)
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    batch_id = await _recorded_batch_id(api_pool, spec.job_id)
    # In a thread: the CPU worker runs on this event loop, and a CLI that takes long
    # to start on a loaded machine must not stop it (it froze it for 65 s in CI).
    done = await asyncio.to_thread(cli, settings, "cancel", spec.job_id)
    assert done.returncode == 0, done.stderr
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert isinstance(failure.value.cause, CancelledError)
    child = temporal_client.get_workflow_handle(f"{spec.job_id}/shard-00000/provider-batch")
    for _ in range(600):
        if (await child.describe()).status != WorkflowExecutionStatus.RUNNING:
            break
        await asyncio.sleep(0.2)
    assert (await child.describe()).status == WorkflowExecutionStatus.CANCELED

    batches = await provider_batches(api_server, key, spec.job_id)
    assert [b["id"] for b in batches] == [batch_id]
    assert batches[0]["status"] in ("cancelling", "cancelled")
    # Nothing is left claimed: what the provider did not answer is pending again.
    running = await api_pool.fetchval(
        "SELECT count(*) FROM items WHERE job_id = $1 AND status = 'running'", spec.job_id
    )
    assert running == 0


async def test_the_cpu_worker_killed_while_the_batch_runs_costs_no_second_batch(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # The job's workflows and CPU steps on a queue of their own, served by worker
    # processes (SIGKILL-able); the provider's own jobs stay on the session's workers.
    workers, api_server, key, _ = provider
    own = workers.model_copy(update={"cpu_task_queue": f"pb-{uuid.uuid4().hex[:8]}"})
    rows = rows_of(40)
    spec = _via_batch(provider, tmp_path, rows, shard_size=40, settings=own)
    first = cpu_worker_process(own, tmp_path / "cpu-1.log")
    try:
        await wait_for_pollers(temporal_client, [own.cpu_task_queue], procs=[first], within_s=180)
        handle, _ = await start_job(temporal_client, spec, settings=own)
        batch_id = await _recorded_batch_id(api_pool, spec.job_id)
        signal_group(first, signal.SIGKILL)  # while the child workflow waits
        first.wait(30)
    finally:
        stop_worker(first)
    second = cpu_worker_process(own, tmp_path / "cpu-2.log")
    try:
        summary = await asyncio.wait_for(job_result(handle), 400)
    finally:
        stop_worker(second)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (40, 40, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    assert [b["id"] for b in batches] == [batch_id]


async def test_the_provider_api_down_for_a_while_is_waited_out(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings, api_server, key, _ = provider
    rows = rows_of(20)
    spec = _via_batch(provider, tmp_path, rows, shard_size=20)
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    batch_id = await _recorded_batch_id(api_pool, spec.job_id)
    # The provider's HTTP API goes away (SIGKILL) while the batch runs behind it; the
    # status checks fail and are retried until it is back.
    api_server.kill()
    try:
        await asyncio.sleep(8)
    finally:
        api_server.start()
    summary = await asyncio.wait_for(job_result(handle), 300)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (20, 20, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    assert [b["id"] for b in batches] == [batch_id]


async def test_a_batch_the_provider_refuses_dead_letters_its_items_with_its_errors(
    provider: Provider,
    temporal_client: Client,
    api_pool: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(provider_activities, "request_line", wrong_url_on_every_line)
    settings, api_server, key, _ = provider
    rows = rows_of(6)
    spec = _via_batch(provider, tmp_path, rows, shard_size=6)
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    summary = await asyncio.wait_for(job_result(handle), 300)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (6, 0, 6)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    batches = await provider_batches(api_server, key, spec.job_id)
    assert len(batches) == 1 and batches[0]["status"] == "failed"
    dead = await api_pool.fetch(
        "SELECT error_class, error_message FROM items WHERE job_id = $1", spec.job_id
    )
    assert {d["error_class"] for d in dead} == {"InvalidRequest"}
    assert all("failed validation" in d["error_message"] for d in dead)
    assert all("does not match the batch endpoint" in d["error_message"] for d in dead), dead[0]


async def test_batch_max_in_flight_holds_across_shards_and_status_says_who_waits(
    provider: Provider, temporal_client: Client, api_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings, api_server, key, _ = provider
    rows = rows_of(12)
    # Three shards, all started at once (max 4 concurrent), one provider batch at a time.
    spec = _via_batch(
        provider, tmp_path, rows, shard_size=4, options=("--batch-max-in-flight", "1")
    )
    assert spec.max_concurrent_shards >= 3
    handle, _ = await start_job(temporal_client, spec, settings=settings)
    job_done = asyncio.ensure_future(job_result(handle))
    held_most, waited_line = 0, ""
    # The session's workers run in this event loop: nothing here may block it (the CLI
    # runs in a thread), or their heartbeats stop.
    for _ in range(6000):
        if job_done.done():
            break
        held = await api_pool.fetchval(
            "SELECT count(*) FROM provider_batch_slots WHERE endpoint = $1 AND slot IS NOT NULL",
            spec.remote_endpoint,
        )
        held_most = max(held_most, held)
        if not waited_line and await api_pool.fetchval(
            "SELECT count(*) FROM provider_batch_slots WHERE job_id = $1 AND slot IS NULL",
            spec.job_id,
        ):
            shown = await asyncio.to_thread(cli, settings, "status", spec.job_id)
            assert shown.returncode == 0, shown.stdout + shown.stderr
            waited_line = next(
                (line for line in shown.stdout.splitlines() if "waiting for a provider" in line),
                "(none)",
            )
        await asyncio.sleep(0.2)
    summary = await asyncio.wait_for(job_done, 1)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (12, 12, 0)
    assert sorted(output_ids(tmp_path, spec.job_id)) == sorted(r["id"] for r in rows)
    assert held_most == 1
    assert "batches in flight, its --batch-max-in-flight" in waited_line, waited_line
    # On the provider's own clock: each batch was created after the one before completed.
    batches = sorted(
        await provider_batches(api_server, key, spec.job_id), key=lambda b: b["created_at"]
    )
    assert sorted(b["metadata"]["shard"] for b in batches) == ["0", "1", "2"]
    assert all(b["status"] == "completed" for b in batches)
    for before, after in itertools.pairwise(batches):
        assert after["created_at"] >= before["completed_at"], (before, after)
    # Every slot was given back.
    left = await api_pool.fetchval(
        "SELECT count(*) FROM provider_batch_slots WHERE job_id = $1", spec.job_id
    )
    assert left == 0
