"""SIGSTOP a GPU worker past its heartbeat timeout; another takes over; SIGCONT the first.

The stopped worker is a zombie: when it wakes up its engine still holds the requests
it had in flight and its ``generate`` attempts go on, but Temporal has given their
shards to the newer worker, which took the items over in the ledger. Whatever the
zombie writes then must change nothing: the lease fence keeps every item's result as
the newer attempt wrote it, and each item still ends exactly once.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.worker_processes import (
    gpu_worker_process,
    items_by_id,
    job_result,
    signal_group,
    stop_holding_items,
    stop_worker,
    until_done,
)

pytestmark = pytest.mark.slow

ROWS, SHARD = 2000, 500


async def until_both_slots_busy(pool: Any, job_id: str) -> None:
    """Wait a while for the worker to run ``generate`` for two shards, its every slot,
    so that it is stopped with no poll open. Best effort: with a free slot Temporal
    may hand it the next shard while it is stopped, and that attempt starts only when
    it wakes, as a stale one whose claim the ledger fences (it takes nothing). A few
    seconds at most: on a loaded machine a longer wait let the job run to its end."""
    for _ in range(100):
        rows = await items_by_id(pool, job_id)
        leases = {r["lease_owner"] for r in rows.values() if r["status"] == "running"}
        if len(leases) == 2:
            return
        await asyncio.sleep(0.05)


async def until_taken_over(pool: Any, job_id: str, held: dict[str, str]) -> None:
    """Wait until a newer attempt holds every item the stopped worker held, and has
    finished some of them."""
    for _ in range(3000):
        rows = await items_by_id(pool, job_id)
        taken = [rows[i] for i, lease in held.items() if rows[i]["lease_owner"] != lease]
        if len(taken) == len(held) and any(r["status"] == "succeeded" for r in taken):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("no newer attempt took the stopped worker's items over in 300 s")


async def test_stopped_gpu_worker_wakes_up_as_a_zombie_and_changes_nothing(
    workers: Settings, temporal_client: Client, tiny_model_path: Path, tmp_path: Path
) -> None:
    stack = workers
    # A model path of its own: a GPU queue only this test's worker processes poll.
    model = str(shutil.copytree(tiny_model_path, tmp_path / "tiny-stop"))
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)))
    spec = JobSpec(
        job_id=f"stop-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model,
        # Random, unseeded sampling: the zombie's answer for an item differs from the
        # newer attempt's, so an overwrite would show in the ledger and the output.
        sampling=SamplingSpec(max_tokens=24, temperature=1.0),
        shard_size=SHARD,
        max_concurrent_shards=2,
        output_uri=f"file://{tmp_path / 'out'}",
    )
    pool = await ledger.db.create_pool(stack.postgres_dsn.get_secret_value())
    zombie_log, second_log = tmp_path / "gpu-zombie.log", tmp_path / "gpu-2.log"
    zombie = gpu_worker_process(stack, model, zombie_log)
    second = None
    try:
        await wait_for_pollers(
            temporal_client, [stack.gpu_task_queue(model)], procs=[zombie], within_s=300
        )
        handle, _ = await start_job(temporal_client, spec, settings=stack)
        await until_done(pool, spec.job_id, ROWS // 8, in_flight=True)
        await until_both_slots_busy(pool, spec.job_id)
        # Frozen at a moment it holds items, read once its last writes committed (a
        # stop between two batches is woken and tried again). A loop of its own here,
        # polling then signalling, once let the whole job finish between its tries.
        await stop_holding_items(pool, spec.job_id, zombie, after=0)
        stopped_at = time.monotonic()
        before = await items_by_id(pool, spec.job_id)
        held = {i: r["lease_owner"] for i, r in before.items() if r["status"] == "running"}
        assert held, "the worker was never stopped with an item in flight"
        second = gpu_worker_process(stack, model, second_log)
        await until_taken_over(pool, spec.job_id, held)
        taken_over_at = time.monotonic()
        # Wake the zombie while the newer attempts still run: its late results race
        # theirs for the same items.
        signal_group(zombie, signal.SIGCONT)
        summary = await asyncio.wait_for(job_result(handle), 900)
        finished_at = time.monotonic()
        at_finish = await items_by_id(pool, spec.job_id)
        # Give the zombie time to flush what its engine finished after waking.
        for _ in range(300):
            if "superseded" in zombie_log.read_text():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)
        after = await items_by_id(pool, spec.job_id)
    finally:
        for proc in (zombie, second):
            if proc is not None:
                stop_worker(proc)
        await pool.close()

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (ROWS, ROWS, 0)
    assert len(after) == ROWS and {r["status"] for r in after.values()} == {"succeeded"}
    # The zombie woke up and wrote nothing: not while the job ran ...
    zombie_leases = set(held.values())
    for item_id in held:
        assert after[item_id]["lease_owner"] not in zombie_leases, item_id
        assert after[item_id]["attempt"] == 2, item_id
    # ... nor after the job ended: the ledger is exactly as the job left it.
    assert after == at_finish
    # What was done before the stop stayed as it was.
    for item_id, row in before.items():
        if row["status"] == "succeeded":
            assert after[item_id] == row, item_id
    # One output line per item, with the result the ledger has.
    out = {}  # JSONL lines end at "\n" only: model text may hold U+2028 and the like
    for part in sorted((tmp_path / "out" / spec.job_id).glob("part-*.jsonl")):
        for line in part.read_text().split("\n")[:-1]:
            row = json.loads(line)
            assert row["item_id"] not in out
            out[row["item_id"]] = row["text"]
    assert out == {i: r["result"]["text"] for i, r in after.items()}
    superseded = "superseded" in zombie_log.read_text()
    done_before = sum(r["status"] == "succeeded" for r in before.values())
    print(
        f"\nGPU worker stopped at {done_before}/{ROWS} done with {len(held)} "
        f"items in flight; taken over {taken_over_at - stopped_at:.1f} s after the stop; "
        f"job finished {finished_at - stopped_at:.1f} s after the stop; "
        f"{sum(1 for r in after.values() if r['attempt'] > 1)} items generated again; "
        f"zombie {'superseded by the ledger fence' if superseded else 'stopped by Temporal'}"
    )
