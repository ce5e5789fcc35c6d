"""SIGKILL the GPU worker in the middle of a job; a new one finishes it, exactly once,
and each distinct prompt of the job is generated once (deduplication across shards
survives the kill).

Real processes: the GPU worker runs as ``llm-batch worker gpu`` (its own vLLM
engine); the kill comes from outside, as a preempted machine's would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from llmbatch.devstack.process import LoggedProcess
from tests.fixtures.worker_processes import (
    gpu_worker_process,
    job_result,
    kill_holding_items,
    stop_worker,
)

pytestmark = pytest.mark.slow

ROWS, SHARD = 3000, 500
# Row i asks about i % DISTINCT: the two shards that run at once hold the same prompts,
# so each leads some and waits for the other's result on the rest.
DISTINCT = 500
# gpu_worker_process: 2 shards at once, 2 x max_num_seqs (64) requests in flight each.
IN_FLIGHT_WINDOW = 2 * 2 * 64


async def test_killed_gpu_worker_is_replaced_and_every_item_ends_once(
    workers: Settings, temporal_client: Client, tiny_model_path: Path, tmp_path: Path
) -> None:
    # The session's in-process CPU worker runs the workflows; the GPU work goes to the
    # worker processes below (the in-process GPU worker serves another model's queue).
    stack = workers
    # A model path of its own gives this test a GPU queue no in-process worker polls.
    model = str(shutil.copytree(tiny_model_path, tmp_path / "tiny-kill"))
    queue = stack.gpu_task_queue(model)
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i % DISTINCT}) + "\n" for i in range(ROWS)))
    spec = JobSpec(
        job_id=f"kill-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model,
        # 64 tokens: the first two shards' results come over seconds, not in two flushes
        # half a second apart, which a loaded CI run's polls missed.
        sampling=SamplingSpec(max_tokens=64, temperature=1.0, seed=1),
        shard_size=SHARD,
        max_concurrent_shards=2,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    pool = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    first = gpu_worker_process(stack, model, tmp_path / "gpu-1.log")
    second: LoggedProcess | None = None
    try:
        await wait_for_pollers(temporal_client, [queue], procs=[first], within_s=300)
        handle, _ = await start_job(temporal_client, spec, settings=stack)
        # Kill while items are claimed and unfinished, not on a shard boundary: while
        # the first two shards run. Every later shard finds all its prompts led and
        # answered when it renders, so it never holds an item.
        at_kill = await kill_holding_items(pool, spec.job_id, first, after=1)
        killed_at = time.monotonic()
        second = gpu_worker_process(stack, model, tmp_path / "gpu-2.log")
        summary = await asyncio.wait_for(job_result(handle), 900)
        resumed_after = time.monotonic() - killed_at
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_worker(proc)
    rows = await pool.fetch(
        "SELECT item_id, status, attempt, prompt_hash, result_source, shared_with FROM items "
        "WHERE job_id = $1",
        spec.job_id,
    )
    usage = await ledger.usage.usage(pool, job_id=spec.job_id)
    await pool.close()

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (ROWS, ROWS, 0)
    assert len(rows) == ROWS and {r["status"] for r in rows} == {"succeeded"}
    out_ids = [
        json.loads(line)["item_id"]
        for part in sorted((tmp_path / "out" / spec.job_id).glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    assert len(out_ids) == ROWS and len(set(out_ids)) == ROWS
    # Exactly what the dead worker held and had not recorded is taken again: never
    # an item already in the ledger, never more than the shards that were running.
    reclaimed = sum(1 for r in rows if r["attempt"] > 1)
    assert reclaimed == at_kill.running
    assert 0 < reclaimed <= 2 * SHARD
    # The first two shards hold every distinct prompt; once one of them ended, each was
    # led and answered, so every later shard was answered at render (never claimed).
    # (The second of the first two may render after some of the first's leads ended.)
    assert sum(1 for r in rows if r["attempt"] == 0) >= ROWS - 2 * SHARD
    # Each distinct prompt has exactly one generated result in the ledger; every other
    # item shares the result of an item with the same prompt.
    generated = [r["prompt_hash"] for r in rows if r["result_source"] == "generated"]
    assert len(generated) == len(set(generated)) == DISTINCT
    hashes = {r["item_id"]: r["prompt_hash"] for r in rows}
    shared = [r for r in rows if r["result_source"] != "generated"]
    assert {r["result_source"] for r in shared} == {"deduplicated"}
    assert all(hashes[r["shared_with"]] == r["prompt_hash"] for r in shared)
    # Engine requests the ledger knows of (counted at the engine adapter; the killed
    # attempts' last unflushed counts died with them): beyond the distinct prompts, at
    # most what was in flight when the worker died.
    assert DISTINCT <= usage.engine_requests <= DISTINCT + IN_FLIGHT_WINDOW
    print(
        f"killed at {at_kill.succeeded}/{ROWS} done; {reclaimed} items claimed again; "
        f"{usage.engine_requests} engine requests for {DISTINCT} distinct prompts; "
        f"job finished {resumed_after:.1f} s after the kill"
    )
