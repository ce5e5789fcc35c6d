"""Each distinct request generated once, on the real stack: in-job deduplication across
shards, the sampled case that must not deduplicate, and the result cache across jobs.

Engine requests are counted at the engine adapter (``Engine.requests_submitted``, and
per attempt in the ledger's ``engine_usage``), never by a stand-in.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobSummary, Usage
from llmbatch.contract.names import GENERATE, PREPARE_SHARD, WRITE_SHARD, shard_workflow_id
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from llmbatch.devstack.tiny_model import build_tiny_model
from llmbatch.ledger import served_models
from llmbatch.workflows.shard import ShardWorkflow
from tests.fixtures.replay import replayer
from tests.fixtures.worker_processes import gpu_worker_process, stop_worker

if TYPE_CHECKING:
    from llmbatch.engine.vllm_engine import Engine

pytestmark = pytest.mark.slow

ROWS, DISTINCT = 5000, 250
JOB_TIMEOUT_S = 600


def _spec(source: Path, out: Path, model: str, **overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": f"dedup-{uuid.uuid4().hex[:8]}",
        "inputs": [str(source)],
        "messages": [ChatMessage(role="user", content="Tell me about {{ name }}.")],
        "model": model,
        "sampling": SamplingSpec(max_tokens=6),
        "output_uri": f"file://{out}",
        "id_field": "id",
        "shard_size": 1000,
        "max_concurrent_shards": 5,
    }
    values.update(overrides)
    return JobSpec(**values)


def _rows_file(path: Path, rows: int, distinct: int) -> Path:
    # Row i asks about company i % distinct: every shard of 1,000 rows meets every
    # distinct prompt, so shards running at once share leads, not just rows.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"id": f"r{i:05d}", "name": f"company {i % distinct}"}) + "\n"
                for i in range(rows))
    )  # fmt: skip
    return path


async def _run(client: Client, settings: Settings, spec: JobSpec) -> JobSummary:
    handle, started = await start_job(client, spec, settings=settings)
    assert started
    return await asyncio.wait_for(handle.result(), JOB_TIMEOUT_S)


def _output(out: Path, job_id: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for part in sorted((out / job_id).glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]


async def _usage(settings: Settings, job_id: str) -> tuple[Usage, int]:
    """The job's usage, and how many dedup leads it left behind."""
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        leads = await pool.fetchval("SELECT count(*) FROM dedup_leads WHERE job_id = $1", job_id)
        return await ledger.usage.usage(pool, job_id=job_id), leads
    finally:
        await pool.close()


async def _claimed(settings: Settings, job_id: str) -> int:
    """How many of the job's items a generate attempt ever claimed."""
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        return int(
            await pool.fetchval(
                "SELECT count(*) FROM items WHERE job_id = $1 AND attempt > 0", job_id
            )
        )
    finally:
        await pool.close()


async def _activities(client: Client, workflow_id: str) -> set[str]:
    """The activity types a workflow scheduled."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return {
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    }


async def test_repeated_requests_are_generated_once_and_a_cached_rerun_needs_no_engine(
    workers: Settings, temporal_client: Client, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    source = _rows_file(tmp_path / "in" / "rows.jsonl", ROWS, DISTINCT)
    out = tmp_path / "out"
    spec = _spec(source, out, model_name, cache=False)

    before = engine.requests_submitted
    summary = await _run(temporal_client, workers, spec)
    requests = engine.requests_submitted - before

    assert summary.state == "succeeded" and summary.items_succeeded == ROWS
    assert requests == DISTINCT
    usage, leads_left = await _usage(workers, spec.job_id)
    assert leads_left == 0  # a finished job's leads are dropped
    assert usage.engine_requests == DISTINCT  # as the attempts recorded it in the ledger
    assert (usage.generated, usage.deduplicated, usage.cached) == (DISTINCT, ROWS - DISTINCT, 0)
    assert summary.usage.generated == DISTINCT and summary.usage.deduplicated == ROWS - DISTINCT
    assert usage.reused_tokens.completion > 0 and usage.gpu_seconds > 0

    rows = _output(out, spec.job_id)
    assert sorted(r["item_id"] for r in rows) == [f"r{i:05d}" for i in range(ROWS)]
    by_id = {r["item_id"]: r for r in rows}
    generated = [r for r in rows if r["result_source"] == "generated"]
    assert len({r["input"]["name"] for r in generated}) == DISTINCT
    for row in rows:
        assert row["error"] is None and row["text"]
        if row["result_source"] == "generated":
            assert row["shared_with"] is None
            continue
        # Shared with an item that generated the same prompt: the right text.
        origin = by_id[row["shared_with"]]
        assert row["result_source"] == "deduplicated"
        assert origin["result_source"] == "generated"
        assert origin["input"]["name"] == row["input"]["name"]
        assert (row["text"], row["completion_tokens"]) == (
            origin["text"],
            origin["completion_tokens"],
        )
    # The Web UI's details line says where the results came from.
    handle = temporal_client.get_workflow_handle(spec.job_id)
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert f"{DISTINCT} generated, {ROWS - DISTINCT} deduplicated, 0 cached" in (
        metadata.current_details
    )
    manifest = json.loads((out / spec.job_id / "manifest.json").read_text())
    assert manifest["usage"]["deduplicated"] == ROWS - DISTINCT
    assert manifest["usage"]["engine_requests"] == DISTINCT

    # The same input as a new job with the cache: every answer from the first job,
    # given at render (the worker recorded its weights), so no shard reaches a worker.
    again = _spec(source, out, model_name, cache=True)
    before = engine.requests_submitted
    rerun = await _run(temporal_client, workers, again)
    assert engine.requests_submitted - before == 0
    assert await _claimed(workers, again.job_id) == 0
    for shard in range(ROWS // 1000):
        # Answered whole: prepare_shard wrote the output part too, in the shard's one step.
        workflow_id = shard_workflow_id(again.job_id, shard)
        assert await _activities(temporal_client, workflow_id) == {PREPARE_SHARD}
    assert rerun.items_succeeded == ROWS
    assert rerun.usage.cached + rerun.usage.deduplicated == ROWS
    assert rerun.usage.cached >= DISTINCT and rerun.usage.generated == 0
    cached = {r["item_id"]: r for r in _output(out, again.job_id)}
    assert {i: r["text"] for i, r in cached.items()} == {i: r["text"] for i, r in by_id.items()}
    first = next(r for r in cached.values() if r["result_source"] == "cached")
    assert first["shared_with"].startswith(f"{spec.job_id}/")


async def test_later_shards_are_answered_at_render_from_the_jobs_own_leads(
    workers: Settings, temporal_client: Client, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    """One shard at a time, without the cache: the first shard generates each distinct
    request; every later shard finds them led and succeeded when it renders, so its
    items are written once, deduplicated, and it never reaches a worker."""
    rows, distinct, shard_size = 400, 20, 100
    source = _rows_file(tmp_path / "in" / "rows.jsonl", rows, distinct)
    spec = _spec(
        source,
        tmp_path / "out",
        model_name,
        shard_size=shard_size,
        max_concurrent_shards=1,
        cache=False,
        # A prompt no other test sends: only this job leads these requests.
        messages=[ChatMessage(role="user", content=f"{uuid.uuid4().hex}: {{{{ name }}}}.")],
    )
    before = engine.requests_submitted
    summary = await _run(temporal_client, workers, spec)

    assert summary.items_succeeded == rows
    assert engine.requests_submitted - before == distinct
    assert (summary.usage.generated, summary.usage.deduplicated) == (distinct, rows - distinct)
    # Only the first shard's items were ever claimed by a generate attempt.
    assert await _claimed(workers, spec.job_id) == shard_size
    assert await _activities(temporal_client, shard_workflow_id(spec.job_id, 0)) == {
        PREPARE_SHARD,
        GENERATE,
        WRITE_SHARD,
    }
    for shard in range(1, rows // shard_size):
        workflow_id = shard_workflow_id(spec.job_id, shard)
        assert await _activities(temporal_client, workflow_id) == {PREPARE_SHARD}
    by_id = {r["item_id"]: r for r in _output(tmp_path / "out", spec.job_id)}
    for row in by_id.values():
        if row["result_source"] == "deduplicated":
            origin = by_id[row["shared_with"]]
            assert origin["result_source"] == "generated"
            assert (origin["input"]["name"], origin["text"]) == (
                row["input"]["name"],
                row["text"],
            )
    # Both kinds of shard replay with today's code: which steps ran is decided by
    # the recorded result of prepare_shard alone.
    replaying = replayer([ShardWorkflow], data_converter=pydantic_data_converter)
    for shard in range(rows // shard_size):
        handle = temporal_client.get_workflow_handle(shard_workflow_id(spec.job_id, shard))
        await replaying.replay_workflow(await handle.fetch_history())


async def test_sampled_requests_without_a_seed_are_each_generated(
    workers: Settings, temporal_client: Client, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    rows, distinct = 1000, 50
    source = _rows_file(tmp_path / "in" / "rows.jsonl", rows, distinct)
    out = tmp_path / "out"
    spec = _spec(
        source, out, model_name, sampling=SamplingSpec(max_tokens=6, temperature=0.7), cache=True
    )

    before = engine.requests_submitted
    summary = await _run(temporal_client, workers, spec)

    assert summary.items_succeeded == rows
    assert engine.requests_submitted - before == rows
    assert (summary.usage.generated, summary.usage.deduplicated, summary.usage.cached) == (
        rows,
        0,
        0,
    )
    assert all(r["result_source"] == "generated" for r in _output(out, spec.job_id))


async def test_no_dedup_generates_every_row(
    workers: Settings, temporal_client: Client, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    rows, distinct = 400, 20
    source = _rows_file(tmp_path / "in" / "rows.jsonl", rows, distinct)
    spec = _spec(source, tmp_path / "out", model_name, dedup=False, cache=False)

    before = engine.requests_submitted
    summary = await _run(temporal_client, workers, spec)

    assert summary.items_succeeded == rows
    assert engine.requests_submitted - before == rows
    assert summary.usage.deduplicated == 0


async def test_a_worker_on_rebuilt_weights_misses_the_cache_its_old_weights_filled(
    workers: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    """A real GPU worker on a model folder, then on the same folder rebuilt with other
    weights (a redeployed model under the same name): its cache entries were keyed by
    the old weights, so the new worker generates everything again."""
    model = str(build_tiny_model(tmp_path / "redeployed-model", seed=0))
    rows, distinct = 40, 40
    source = _rows_file(tmp_path / "in" / "rows.jsonl", rows, distinct)
    out = tmp_path / "out"
    queue = workers.gpu_task_queue(model)

    async def run_on_a_worker(log: str, *specs: JobSpec) -> list[Usage]:
        proc = gpu_worker_process(workers, model, tmp_path / log)
        try:
            await wait_for_pollers(temporal_client, [queue], procs=[proc], within_s=300)
            usages = []
            for spec in specs:
                summary = await _run(temporal_client, workers, spec)
                assert summary.items_succeeded == rows
                usages.append((await _usage(workers, spec.job_id))[0])
            return usages
        finally:
            stop_worker(proc)

    filled, hit = await run_on_a_worker(
        "worker-old-weights.log",
        _spec(source, out, model, cache=True),
        _spec(source, out, model, cache=True),
    )
    assert (filled.generated, filled.cached) == (distinct, 0)
    assert (hit.generated, hit.cached, hit.engine_requests) == (0, distinct, 0)
    # The stopped worker's weights no longer answer for its queue at render.
    pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value())
    try:
        assert await served_models.cache_policy(pool, task_queue=queue) is None
    finally:
        await pool.close()

    build_tiny_model(Path(model), seed=1)  # same folder, same name, other weights
    (missed,) = await run_on_a_worker(
        "worker-new-weights.log", _spec(source, out, model, cache=True)
    )
    assert (missed.generated, missed.cached, missed.engine_requests) == (distinct, 0, distinct)
