"""Priorities and fair sharing between tenants on one GPU worker, from the ledger.

Starts an embedded stack of its own (free ports, a temporary state folder), the tiny
local model and one CPU and one GPU worker process, then runs, ``--repeats`` times:

(a) priority: a large priority-5 job keeps the GPU worker busy; once its generate
    steps queue up, a small job is submitted at priority 1, and (the peer, same run)
    at priority 5 like the large one. Printed: the small job's time from submit to
    end, how much of the large job was done by then, and when the large job ended.
(c) a late tenant: the same with the large job as tenant team-a and the small one
    as team-b (equal weights); the peer runs both without tenants.
(b) fairness: two tenants submit equal jobs at once. Each tenant's GPU throughput
    while both run is counted from the ledger (``items.finished_at`` inside the span
    where both jobs finish items), with equal weights (target: within 20% of each
    other), with weights 2:1, and (the peer) without tenants.

    .venv/bin/python benchmarks/priority_fairness.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
from peer import finished
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import ledger, storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.names import GENERATE, shard_workflow_id
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.devstack.demo import wait_for_pollers, worker_processes
from llmbatch.devstack.tiny_model import build_tiny_model

# The KV cache in bytes (256 sequences of 512 tokens need ~270 MB with the tiny model):
# on CPU a --gpu-memory-utilization share is of one memory node, which on some machines
# holds a fraction of the RAM, so a share that works on one machine fails on another.
ENGINE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "128",
    "--kv-cache-memory-bytes", str(512 << 20),
]  # fmt: skip


@dataclass(frozen=True)
class Bench:
    settings: Settings
    client: Client
    pool: asyncpg.Pool
    model: str
    shard_size: int
    max_tokens: int

    def upload(self, name: str, rows: int) -> str:
        uri = f"s3://{self.settings.s3_bucket}/bench-priority/{name}.jsonl"
        body = "".join(json.dumps({"text": f"{name} row {i}"}) + "\n" for i in range(rows))
        storage.stores.open_store(uri, self.settings).put_bytes(uri, body.encode())
        return uri

    def spec(self, name: str, rows: int, **fields: Any) -> JobSpec:
        return JobSpec(
            job_id=f"{name}-{uuid.uuid4().hex[:8]}",
            inputs=[self.upload(name, rows)],
            messages=[ChatMessage(role="user", content="Write about {{ text }}.")],
            model=self.model,
            sampling=SamplingSpec(max_tokens=self.max_tokens),
            output_uri=f"s3://{self.settings.s3_bucket}/bench-priority-out",
            shard_size=self.shard_size,
            **fields,
        )

    async def run(self, spec: JobSpec) -> float:
        """Start ``spec``; its seconds from start to end."""
        started = time.monotonic()
        handle, _ = await start_job(self.client, spec, settings=self.settings)
        while True:
            try:
                summary = await handle.result()
                break
            except RPCError as exc:  # a long poll timed out on a loaded machine: poll again
                if exc.status is not RPCStatusCode.DEADLINE_EXCEEDED:
                    raise
        assert summary.items_succeeded == summary.items_total, summary
        return time.monotonic() - started

    async def queued_generates(self, job_id: str, shards: int) -> int:
        """How many of the job's generate steps are scheduled and not yet started."""
        waiting = 0
        for shard in range(shards):
            handle = self.client.get_workflow_handle(shard_workflow_id(job_id, shard))
            try:
                described = await handle.describe()
            except Exception:  # not started yet
                continue
            waiting += sum(
                1
                for p in described.raw_description.pending_activities
                if p.activity_type.name == GENERATE
                and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
            )
        return waiting

    async def finished_at(self, job_id: str) -> list[datetime]:
        rows = await self.pool.fetch(
            "SELECT finished_at FROM items WHERE job_id = $1 AND status = 'succeeded'"
            " ORDER BY finished_at",
            job_id,
        )
        return [r["finished_at"] for r in rows]


@dataclass(frozen=True)
class OvertakeRound:
    small_s: float  # the small job, submit to end
    large_done: float  # share of the large job done when the small one ended
    large_after_s: float  # the large job's end after the small one's


async def overtake_round(
    b: Bench,
    *,
    large_shards: int,
    small_rows: int,
    backlog: int,
    large_fields: dict[str, Any],
    small_fields: dict[str, Any],
) -> OvertakeRound:
    """A large job takes the GPU worker, all its shards at once; once ``backlog`` of
    its generate steps queue, a small job is submitted and runs to its end."""
    large = b.spec(
        "large", large_shards * b.shard_size, max_concurrent_shards=large_shards, **large_fields
    )
    large_task = asyncio.create_task(b.run(large))
    while await b.queued_generates(large.job_id, large_shards) < backlog:  # noqa: ASYNC110
        await asyncio.sleep(0.2)  # polling Temporal: there is no event to wait on
    small = b.spec("small", small_rows, **small_fields)
    small_s = await b.run(small)
    small_end = time.monotonic()
    counts = await ledger.jobs.job_counts(b.pool, job_id=large.job_id)
    await large_task
    return OvertakeRound(
        small_s=small_s,
        large_done=counts.succeeded / counts.total,
        large_after_s=time.monotonic() - small_end,
    )


@dataclass(frozen=True)
class FairRound:
    rate_a: float  # items/s of tenant a while both ran
    rate_b: float
    overlap_s: float


async def fairness_round(
    b: Bench, *, rows: int, weights: tuple[float, float] | None, window: int
) -> FairRound:
    specs = []
    for name, weight in zip(("team-a", "team-b"), weights or (None, None), strict=True):
        fields: dict[str, Any] = {"max_concurrent_shards": window}
        if weights is not None:
            fields.update(tenant=name, tenant_weight=weight)
        specs.append(b.spec(name, rows, **fields))
    await asyncio.gather(*(b.run(s) for s in specs))
    a, c = [await b.finished_at(s.job_id) for s in specs]
    start, end = max(a[0], c[0]), min(a[-1], c[-1])
    span = (end - start).total_seconds()
    in_a = sum(1 for t in a if start <= t <= end)
    in_b = sum(1 for t in c if start <= t <= end)
    return FairRound(rate_a=in_a / span, rate_b=in_b / span, overlap_s=span)


async def bench(args: argparse.Namespace, settings: Settings, model: str, work: Path) -> None:
    client = await connect(settings)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    b = Bench(
        settings=settings,
        client=client,
        pool=pool,
        model=model,
        shard_size=args.shard_size,
        max_tokens=args.max_tokens,
    )
    gpu_args = [*ENGINE_ARGS, "--concurrent-shards", str(args.gpu_slots)]
    # (a) priority 1 against the peer at priority 5; (c) a late tenant against the
    # peer without tenants. Each: a large job, then a small one once the large queues.
    overtakes: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "priority 1": ({"priority": 5}, {"priority": 1}),
        "priority 5 (peer)": ({"priority": 5}, {"priority": 5}),
        "tenant team-b": ({"tenant": "team-a"}, {"tenant": "team-b"}),
        "no tenants (peer)": ({}, {}),
    }
    over: dict[str, list[OvertakeRound]] = {k: [] for k in overtakes}
    fair: dict[str, list[FairRound]] = {"1:1": [], "2:1": [], "none": []}
    weights: dict[str, tuple[float, float] | None] = {"1:1": (1.0, 1.0), "2:1": (2.0, 1.0)}
    with worker_processes(settings, model, log_dir=work / "logs", gpu_args=gpu_args) as procs:
        await wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model)],
            procs=procs,
            within_s=600,
        )
        for round_ in range(args.repeats):
            print(f"round {round_ + 1}/{args.repeats}", flush=True)
            # Alternate the order, so a warming machine favours neither side.
            keys = list(overtakes) if round_ % 2 == 0 else list(reversed(overtakes))
            for key in keys:
                large_fields, small_fields = overtakes[key]
                r = await overtake_round(
                    b,
                    large_shards=args.large_shards,
                    small_rows=args.small_rows,
                    backlog=args.backlog,
                    large_fields=large_fields,
                    small_fields=small_fields,
                )
                over[key].append(r)
                print(
                    f"  small job, {key}: {r.small_s:.1f} s, large job "
                    f"{100 * r.large_done:.0f}% done then, ended {r.large_after_s:.1f} s later",
                    flush=True,
                )
            for key in ("1:1", "2:1", "none"):
                f = await fairness_round(
                    b, rows=args.tenant_rows, weights=weights.get(key), window=args.window
                )
                fair[key].append(f)
                print(
                    f"  tenants {key}: team-a {f.rate_a:.1f} items/s, team-b {f.rate_b:.1f} "
                    f"items/s over {f.overlap_s:.1f} s",
                    flush=True,
                )
    await pool.close()
    report(args, over, fair)


def report(
    args: argparse.Namespace,
    over: dict[str, list[OvertakeRound]],
    fair: dict[str, list[FairRound]],
) -> None:
    med = statistics.median
    print(
        f"\nmedians of {args.repeats} rounds; one GPU worker running {args.gpu_slots} shards at "
        f"once; {args.shard_size} items a shard, {args.max_tokens} tokens an item"
    )

    def overtake(title: str, ours: str, peer: str) -> None:
        print(title)
        for key in (ours, peer):
            runs = over[key]
            print(
                f"  {key:18} small job ends {med(r.small_s for r in runs):5.1f} s after submit; "
                f"large job {100 * med(r.large_done for r in runs):3.0f}% done then, ends "
                f"{med(r.large_after_s for r in runs):5.1f} s after it"
            )
        ratio = med(r.small_s for r in over[peer]) / med(r.small_s for r in over[ours])
        print(f"  small job's time, peer / ours: {ratio:.2f}x")

    what = (
        f"large job {args.large_shards * args.shard_size} items (all shards at once), small job "
        f"{args.small_rows} items submitted once {args.backlog} of the large job's generate "
        "steps queue"
    )
    overtake(f"(a) priority: {what}, large at priority 5:", "priority 1", "priority 5 (peer)")
    overtake(f"(c) a late tenant: {what}, large as team-a:", "tenant team-b", "no tenants (peer)")
    print(
        f"(b) two tenants, {args.tenant_rows} items each, submitted at once (window "
        f"{args.window} shards each); GPU throughput while both run, from items.finished_at:"
    )
    for key, label in (("1:1", "weights 1:1"), ("2:1", "weights 2:1"), ("none", "no tenants")):
        rounds = fair[key]
        a, b = med(r.rate_a for r in rounds), med(r.rate_b for r in rounds)
        ratios = [r.rate_a / r.rate_b for r in rounds]
        print(
            f"  {label:12} team-a {a:6.1f} items/s, team-b {b:6.1f} items/s, split "
            f"{100 * a / (a + b):.0f}/{100 * b / (a + b):.0f}, a/b {med(ratios):.2f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gpu-slots", type=int, default=2, help="shards the GPU worker runs")
    parser.add_argument("--large-shards", type=int, default=24)
    parser.add_argument("--small-rows", type=int, default=20)
    parser.add_argument("--backlog", type=int, default=4)
    parser.add_argument("--tenant-rows", type=int, default=800)
    parser.add_argument("--window", type=int, default=4, help="max_concurrent_shards per job")
    parser.add_argument("--model", help="model path; default the tiny local model")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmbatch-bench-priority-"))
    settings = isolated_settings(work / "state")
    dev = DevStack(settings)
    dev.up()
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model = args.model or str(build_tiny_model(work / "models" / "tiny-llama"))
        asyncio.run(bench(args, settings, model, work))
    finally:
        dev.down()

    finished(work)


if __name__ == "__main__":
    main()
