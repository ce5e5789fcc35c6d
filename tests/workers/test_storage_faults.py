"""Storage faults: throttling is ridden out, an outage past the retry budget dead-letters.

A FaultInjectingS3Proxy stands between the workers and SeaweedFS (S3 cannot be told
to throttle on demand). The workers are the real CPU and GPU workers, run in this
process on task queues of their own and with the proxy as their S3 endpoint; the
test reads inputs and outputs straight from SeaweedFS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, RetrySpec, SamplingSpec
from llmbatch.engine.vllm_engine import Engine
from llmbatch.workers.cpu import cpu_worker
from llmbatch.workers.gpu import gpu_worker
from tests.fixtures.s3_faults import FaultInjectingS3Proxy
from tests.fixtures.worker_processes import items_by_id, job_result

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def workers_behind(
    proxy: FaultInjectingS3Proxy,
    stack: Settings,
    client: Client,
    engine: Engine,
    model: str,
) -> AsyncIterator[Settings]:
    """A CPU and a GPU worker on queues of their own whose S3 traffic goes through
    ``proxy``; yields the settings to start jobs with."""
    name = f"s3faults-{uuid.uuid4().hex[:8]}"
    own = stack.model_copy(
        update={
            "cpu_task_queue": name,
            "gpu_task_queue_prefix": f"{name}-gpu",
            "s3_endpoint_url": proxy.url,
        }
    )
    async with (
        cpu_worker(own, client=client),
        gpu_worker(own, engine, model=model, client=client),
    ):
        yield own


def job(bucket: str, model: str, rows: int, **overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": f"s3faults-{uuid.uuid4().hex[:8]}",
        "inputs": [f"s3://{bucket}/in/rows.jsonl"],
        "messages": [ChatMessage(role="user", content="Tell me about {{ n }}.")],
        "model": model,
        "sampling": SamplingSpec(max_tokens=8),
        "shard_size": 100,
        "max_concurrent_shards": 3,
        "output_uri": f"s3://{bucket}/out",
    }
    values.update(overrides)
    return JobSpec(**values)


def put_rows(s3: Any, bucket: str, rows: int) -> None:
    body = "".join(json.dumps({"n": i}) + "\n" for i in range(rows)).encode()
    s3.put_object(Bucket=bucket, Key="in/rows.jsonl", Body=body)


def output_lines(s3: Any, bucket: str, job_id: str) -> list[dict[str, Any]]:
    """Every line of the job's output parts, read straight from the store; each part
    must be complete (end in a newline, every line JSON)."""
    root = f"out/{job_id}/"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=root).get("Contents", [])
    lines: list[dict[str, Any]] = []
    for obj in listed:
        name = obj["Key"][len(root) :]
        if not name.startswith("part-"):
            continue
        body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode()
        assert body.endswith("\n"), f"{obj['Key']} is cut off"
        lines += [json.loads(line) for line in body.split("\n")[:-1]]
    return lines


async def test_throttling_storage_is_ridden_out_with_no_dead_item(
    workers: Settings,
    temporal_client: Client,
    engine: Engine,
    model_name: str,
    bucket: str,
    s3_client: Any,
) -> None:
    rows = 1000
    put_rows(s3_client, bucket, rows)
    spec = job(bucket, model_name, rows)
    with FaultInjectingS3Proxy(workers.s3_endpoint_url or "", failure_rate=0.2, seed=4) as proxy:
        async with workers_behind(proxy, workers, temporal_client, engine, model_name) as own:
            started_at = time.monotonic()
            handle, _ = await start_job(temporal_client, spec, settings=own)
            summary = await asyncio.wait_for(job_result(handle), 600)
            elapsed = time.monotonic() - started_at
    pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value())
    try:
        items = await items_by_id(pool, spec.job_id)
    finally:
        await pool.close()

    # The faults were there, and none of them reached an item.
    assert proxy.injected["SlowDown"] >= 10, proxy.injected
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (rows, rows, 0)
    assert summary.state == "succeeded" and not summary.failed_shards
    assert len(items) == rows and {r["status"] for r in items.values()} == {"succeeded"}
    out = output_lines(s3_client, bucket, spec.job_id)
    assert len(out) == rows and {o["item_id"] for o in out} == set(items)
    regenerated = sum(1 for r in items.values() if r["attempt"] > 1)
    print(
        f"\n20% of S3 calls answered 503 SlowDown ({proxy.injected['SlowDown']} of "
        f"{sum(proxy.calls.values())}); job finished in {elapsed:.1f} s with no dead item; "
        f"{regenerated} items generated again"
    )


async def test_storage_outage_past_the_retry_budget_dead_letters_with_a_reason(
    workers: Settings,
    temporal_client: Client,
    engine: Engine,
    model_name: str,
    bucket: str,
    s3_client: Any,
) -> None:
    rows, shard_size = 600, 100
    put_rows(s3_client, bucket, rows)
    # One shard at a time, and a budget of two attempts per step.
    spec = job(
        bucket,
        model_name,
        rows,
        shard_size=shard_size,
        max_concurrent_shards=1,
        retry=RetrySpec(max_activity_attempts=2),
    )
    broken = 2
    staged_rows = f"/out/{spec.job_id}/_staging/shard-{broken:05d}/rows.jsonl"
    with FaultInjectingS3Proxy(workers.s3_endpoint_url or "") as proxy:
        # The outage begins as shard 2 stages its rows (inside prepare_shard) and lasts
        # until that shard has given up: every call fails meanwhile.
        hold = proxy.hold(lambda method, path: method == "PUT" and path.endswith(staged_rows))
        async with workers_behind(proxy, workers, temporal_client, engine, model_name) as own:
            handle, _ = await start_job(temporal_client, spec, settings=own)
            await asyncio.to_thread(hold.wait_arrived, 300)
            proxy.set_outage(True)
            outage_at = time.monotonic()
            hold.release()  # that upload goes through; every call after it fails
            pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value())
            try:
                # Down until the broken shard's items are dead-lettered.
                for _ in range(6000):
                    counts = await ledger.jobs.job_counts(pool, job_id=spec.job_id)
                    if counts.dead >= shard_size:
                        break
                    await asyncio.sleep(0.1)
                proxy.set_outage(False)
                outage_s = time.monotonic() - outage_at
                summary = await asyncio.wait_for(job_result(handle), 900)
                finished_s = time.monotonic() - outage_at
                items = await items_by_id(pool, spec.job_id)
                dead_letters = await ledger.dead_letters.dead_items(pool, job_id=spec.job_id)
            finally:
                await pool.close()

    # Nothing lost: every item ended, succeeded or dead, once.
    assert summary.items_total == rows
    assert summary.items_succeeded + summary.items_dead == rows
    assert len(items) == rows
    dead = {i: r for i, r in items.items() if r["status"] == "dead"}
    succeeded = {i: r for i, r in items.items() if r["status"] == "succeeded"}
    assert len(dead) + len(succeeded) == rows
    assert (summary.items_succeeded, summary.items_dead) == (len(succeeded), len(dead))
    # The outage cost exactly the shard it hit: its items are dead, with the reason.
    assert {r["shard"] for r in dead.values()} == {broken}
    assert len(dead) == shard_size
    assert summary.failed_shards == [broken]
    for row in dead.values():
        assert row["error_class"] and row["error_message"], row
        assert "503" in row["error_message"] or "unavailable" in row["error_message"].lower()
    assert {d.item_id for d in dead_letters} == set(dead)
    # The other shards' output is complete.
    out = output_lines(s3_client, bucket, spec.job_id)
    assert {o["item_id"] for o in out if o["error"] is None} == set(succeeded)
    print(
        f"\nS3 down for {outage_s:.1f} s from shard {broken}'s fetch: its {len(dead)} items "
        f"dead-lettered ({next(iter(dead.values()))['error_message'][:160]!r}); job finished "
        f"{finished_s:.1f} s after the outage began; {len(succeeded)} succeeded"
    )
