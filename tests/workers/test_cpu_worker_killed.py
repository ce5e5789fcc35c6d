"""SIGKILL a CPU worker inside prepare_shard, and another inside write_shard.

Real processes: the CPU worker runs as ``llm-batch worker cpu`` on a task queue of
its own (so the session's in-process CPU worker cannot take its work), with its S3
traffic through a FaultInjectingS3Proxy. The proxy gives the kills their moment: it
holds the worker's upload of a shard's staged rows (in prepare_shard, before it renders),
and later of an output part (write_shard), after half of the body has gone to the
S3 server. The worker is SIGKILLed while the upload hangs there, so the server sees
an upload cut off mid-body, and a new worker takes over. Generation runs on the
session's in-process GPU worker.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.s3_faults import FaultInjectingS3Proxy
from tests.fixtures.worker_processes import (
    cpu_worker_process,
    items_by_id,
    job_result,
    signal_group,
    stop_worker,
)

pytestmark = pytest.mark.slow

ROWS, SHARD = 600, 100
FETCH_KILL_SHARD, WRITE_KILL_SHARD = 1, 3


def object_exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


async def kill_when_held(proxy_hold: Any, proc: Any, what: str) -> tuple[str, float]:
    """SIGKILL ``proc``'s group as soon as its upload is held; return the held path and
    the time of the kill."""
    path = await asyncio.to_thread(proxy_hold.wait_arrived, 300)
    signal_group(proc, signal.SIGKILL)
    killed_at = time.monotonic()
    await asyncio.to_thread(proc.wait, 30)
    # The proxy notices the client is gone and cuts the upload off mid-body.
    for _ in range(200):
        if proxy_hold.outcomes:
            break
        await asyncio.sleep(0.05)
    assert proxy_hold.outcomes == [(path, "client-gone")], f"{what}: {proxy_hold.outcomes}"
    return path, killed_at


async def test_cpu_worker_killed_in_prepare_and_in_write_every_item_once(
    workers: Settings,
    temporal_client: Client,
    bucket: str,
    s3_client: Any,
    model_name: str,
    tmp_path: Path,
) -> None:
    s3_client.put_object(
        Bucket=bucket,
        Key="in/rows.jsonl",
        Body="".join(json.dumps({"n": i}) + "\n" for i in range(ROWS)).encode(),
    )
    spec = JobSpec(
        job_id=f"cpu-kill-{uuid.uuid4().hex[:8]}",
        inputs=[f"s3://{bucket}/in/rows.jsonl"],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model_name,
        sampling=SamplingSpec(max_tokens=8, temperature=1.0),
        shard_size=SHARD,
        max_concurrent_shards=2,
        output_uri=f"s3://{bucket}/out",
    )
    root = f"out/{spec.job_id}"
    rows_key = f"{root}/_staging/shard-{FETCH_KILL_SHARD:05d}/rows.jsonl"
    part_key = f"{root}/part-{WRITE_KILL_SHARD:05d}.jsonl"
    pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value())
    procs = []
    with FaultInjectingS3Proxy(workers.s3_endpoint_url or "") as proxy:
        # A CPU queue of its own; the GPU queue stays the session's in-process worker's.
        own = workers.model_copy(
            update={
                "cpu_task_queue": f"cpu-kill-{uuid.uuid4().hex[:8]}",
                "s3_endpoint_url": proxy.url,
            }
        )
        in_prepare = proxy.hold(lambda method, path: method == "PUT" and path.endswith(rows_key))
        in_write = proxy.hold(lambda method, path: method == "PUT" and path.endswith(part_key))
        try:
            for n in range(3):
                procs.append(cpu_worker_process(own, tmp_path / f"cpu-{n}.log"))
            first, second, third = procs
            # One worker polls at a time: the next one starts only once its
            # predecessor is dead, so the held upload is always the live worker's.
            for proc in (second, third):
                signal_group(proc, signal.SIGSTOP)
            await wait_for_pollers(
                temporal_client, [own.cpu_task_queue], procs=[first], within_s=120
            )
            started_at = time.monotonic()
            handle, _ = await start_job(temporal_client, spec, settings=own)

            _, prepare_killed_at = await kill_when_held(in_prepare, first, "prepare_shard")
            # The cut-off upload left nothing behind.
            assert not object_exists(s3_client, bucket, rows_key)
            signal_group(second, signal.SIGCONT)

            _, write_killed_at = await kill_when_held(in_write, second, "write_shard")
            assert not object_exists(s3_client, bucket, part_key)
            signal_group(third, signal.SIGCONT)

            summary = await asyncio.wait_for(job_result(handle), 600)
            finished_at = time.monotonic()
        finally:
            for proc in procs:
                stop_worker(proc)
    rows = await items_by_id(pool, spec.job_id)
    await pool.close()

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (ROWS, ROWS, 0)
    assert len(rows) == ROWS and {r["status"] for r in rows.values()} == {"succeeded"}
    # The CPU kills cost no generation: no item was claimed twice.
    regenerated = sum(1 for r in rows.values() if r["attempt"] > 1)
    assert regenerated == 0

    # Exactly one output object per shard (plus the manifest), each complete; hidden
    # folders (``_plans``, ``_staging``) are the job's own bookkeeping, not output.
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{root}/")
    keys = sorted(
        o["Key"]
        for o in listed.get("Contents", [])
        if not o["Key"][len(root) + 1 :].startswith("_")
    )
    parts = [f"{root}/part-{n:05d}.jsonl" for n in range(ROWS // SHARD)]
    assert keys == sorted([*parts, f"{root}/manifest.json"])
    out_ids: list[str] = []
    for key in parts:
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        assert body.endswith("\n"), f"{key} is cut off"
        lines = [json.loads(line) for line in body.split("\n")[:-1]]
        assert len(lines) == SHARD, key
        out_ids += [line["item_id"] for line in lines]
    assert len(out_ids) == ROWS and set(out_ids) == set(rows)
    print(
        f"\nCPU worker killed in prepare_shard {prepare_killed_at - started_at:.1f} s into the "
        f"job and in write_shard {write_killed_at - started_at:.1f} s in; job finished "
        f"{finished_at - write_killed_at:.1f} s after the second kill "
        f"({finished_at - prepare_killed_at:.1f} s after the first); "
        f"{regenerated} items generated again; proxy saw {dict(proxy.calls)}"
    )
