"""One very large job: does it finish exactly once with flat worker memory, bounded
histories, and what does the ledger cost per item?

A chat batch file of ``--requests`` lines made of ``--distinct`` greedy requests
repeated (so deduplication answers most of them and the tiny CPU engine is not the
limit), streamed to disk and to the object store, then one job on the embedded
stack with a CPU and a GPU worker process. While it runs, every ``--every`` seconds
it prints items done (from the job's progress query, which counts whole shards),
items/s over the interval, both workers' RSS (with their children) and the job
workflow's history length. At the end: the job's summary, worker RSS at start and
end, the job workflow's runs (it continues as new) and a sample of shard history
lengths, the ledger's bytes per item (Postgres relation sizes before and after,
over the tables the job writes) and the CPU seconds of every process.

    .venv/bin/python benchmarks/large_job.py --requests 10000000 --distinct 10000
    .venv/bin/python benchmarks/large_job.py --requests 200000 --distinct 1000

It is not part of CI: 10 million items take an hour or more on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import psutil

# benchmarks/peer.py: a script's own folder is on its import path.
from peer import cpu_seconds, finished, iter_chat_lines, load
from temporalio.client import Client

from llmbatch import ledger, storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import PROGRESS_QUERY
from llmbatch.contract.spec import JobSpec
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.devstack.demo import wait_for_pollers, worker_processes
from llmbatch.devstack.tiny_model import build_tiny_model

# As benchmarks/dedup_cache.py: the KV cache in bytes, never a share of a memory node.
ENGINE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "256",
    "--kv-cache-memory-bytes", str(512 << 20),
]  # fmt: skip
# The tables a job's items, results and bookkeeping land in.
LEDGER_TABLES = ["items", "shards", "jobs", "result_cache", "dedup_leads", "engine_usage"]
# Shard workflows described at the end (all of them for a small job).
SHARD_SAMPLE = 200


def rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its children, in MiB."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


async def ledger_bytes(pool: object) -> dict[str, int]:
    rows = await pool.fetch(  # type: ignore[attr-defined]
        "SELECT t, pg_total_relation_size(t::regclass) AS size FROM unnest($1::text[]) AS t",
        LEDGER_TABLES,
    )
    return {r["t"]: int(r["size"]) for r in rows}


async def history_lengths(client: Client, job_id: str, shards: int) -> tuple[list[int], list[int]]:
    """The job workflow's runs' history lengths (newest first), and a sample of its
    shard workflows'."""
    runs = [
        w.history_length
        async for w in client.list_workflows(f"WorkflowId = '{job_id}'")
        if w.history_length is not None
    ]
    picked = range(shards) if shards <= SHARD_SAMPLE else random.sample(range(shards), SHARD_SAMPLE)
    limit = asyncio.Semaphore(16)

    async def length(shard: int) -> int:
        async with limit:
            described = await client.get_workflow_handle(f"{job_id}/shard-{shard:05d}").describe()
            return described.raw_description.workflow_execution_info.history_length

    return runs, list(await asyncio.gather(*(length(s) for s in picked)))


async def run(
    settings: Settings,
    model: str,
    data_uri: str,
    n: int,
    log_dir: Path,
    parts: dict[str, int],
    *,
    shard_size: int | None,
    concurrent: int,
    every: float,
) -> None:
    client = await connect(settings)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    with worker_processes(settings, model, log_dir=log_dir, gpu_args=list(ENGINE_ARGS)) as procs:
        await wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model)],
            procs=procs,
            within_s=900,
        )
        cpu, gpu = procs
        watched = {"cpu worker": cpu.pid, "gpu worker+engine": gpu.pid, **parts}
        rss_start = {"cpu worker": rss_mb(cpu.pid), "gpu worker": rss_mb(gpu.pid)}
        bytes_before = await ledger_bytes(pool)
        cpu_before = {name: cpu_seconds(pid) for name, pid in watched.items()}
        spec = JobSpec(
            job_id=f"large-{uuid.uuid4().hex[:8]}",
            inputs=[data_uri],
            model=model,
            output_uri=f"s3://{settings.s3_bucket}/large-out",
            shard_size=shard_size,
            max_concurrent_shards=concurrent,
        )
        started = time.monotonic()
        handle, _ = await start_job(client, spec, settings=settings)
        result = asyncio.ensure_future(handle.result())
        last_done, last_t = 0, started
        rates: list[float] = []
        print("    s      done   items/s  cpu MiB  gpu MiB  job history  load", flush=True)
        while not result.done():
            await asyncio.wait([result], timeout=every)
            if result.done():
                break
            progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
            now = time.monotonic()
            rate = (progress.items_succeeded - last_done) / (now - last_t)
            if progress.items_succeeded:
                rates.append(rate)
            history = (await handle.describe()).raw_description.workflow_execution_info
            print(
                f"{now - started:7.0f} {progress.items_succeeded:9d} {rate:9.0f} "
                f"{rss_mb(cpu.pid):8.0f} {rss_mb(gpu.pid):8.0f} {history.history_length:12d}  "
                f"{load()}",
                flush=True,
            )
            last_done, last_t = progress.items_succeeded, now
        summary: JobSummary = result.result()
        wall = time.monotonic() - started
        cpu_after = {name: cpu_seconds(pid) for name, pid in watched.items()}
        rss_end = {"cpu worker": rss_mb(cpu.pid), "gpu worker": rss_mb(gpu.pid)}
        bytes_after = await ledger_bytes(pool)
        shards = len(await ledger.jobs.planned_shards(pool, job_id=spec.job_id))
        runs, shard_lengths = await history_lengths(client, spec.job_id, shards)
    await pool.close()

    print(f"\n{spec.job_id}: {summary.items_succeeded} succeeded, {summary.items_dead} dead "
          f"of {n}; {summary.usage.describe()}")  # fmt: skip
    assert summary.items_succeeded == n and summary.items_dead == 0, summary
    print(f"  wall {wall:.0f} s, {n / wall:.0f} items/s; interval rates min/median/max "
          f"{min(rates, default=0):.0f}/{statistics.median(rates or [0]):.0f}/"
          f"{max(rates, default=0):.0f} (load now {load()})")  # fmt: skip
    for name in rss_start:
        print(f"  {name} RSS: {rss_start[name]:.0f} MiB at start, {rss_end[name]:.0f} at end")
    print(f"  job workflow: {len(runs)} runs, history lengths {runs}")
    print(f"  shard workflows ({len(shard_lengths)} of {shards}): history length "
          f"median {statistics.median(shard_lengths):.0f}, max {max(shard_lengths)}")  # fmt: skip
    delta = {t: bytes_after[t] - bytes_before[t] for t in LEDGER_TABLES}
    print(f"  ledger: {sum(delta.values()) / n:.0f} bytes per item "
          + ", ".join(f"{t} {d / n:.0f}" for t, d in delta.items() if d))  # fmt: skip
    print("  CPU seconds during the job (ms per item):")
    for name in watched:
        spent = cpu_after[name] - cpu_before[name]
        print(f"    {name:12s} {spent:8.1f} s  {spent * 1000 / n:6.3f}")


def write_input(path: Path, n: int, *, model: str, distinct: int, max_tokens: int) -> None:
    with path.open("w") as out:
        out.writelines(
            iter_chat_lines(n, model=model, max_tokens=max_tokens, repeat=max(n // distinct, 1))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000_000)
    parser.add_argument("--distinct", type=int, default=10_000, help="distinct requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--shard-size", type=int, default=JobSpec.model_fields["shard_size"].default
    )
    parser.add_argument(
        "--concurrent-shards",
        type=int,
        default=JobSpec.model_fields["max_concurrent_shards"].default,
    )
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--model", help="model path; default the tiny local model")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmbatch-large-bench-"))
    settings = isolated_settings(work / "stack")
    dev = DevStack(settings)
    dev.up()
    try:
        parts = {p.name: p.pid for p in dev.status().parts if p.pid is not None}
        model = args.model or str(build_tiny_model(work / "models" / "tiny-llama"))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        n = args.requests
        src = work / "batch.jsonl"
        began = time.monotonic()
        write_input(src, n, model=model, distinct=args.distinct, max_tokens=args.max_tokens)
        data_uri = f"s3://{settings.s3_bucket}/bench/large-{n}.jsonl"
        storage.stores.open_store(data_uri, settings).put_file(data_uri, src)
        print(f"{n} requests ({args.distinct} distinct, {src.stat().st_size / 2**20:.0f} MiB) "
              f"written and uploaded in {time.monotonic() - began:.0f} s; "
              f"{args.shard_size or 'growing'} rows per shard, {args.concurrent_shards} at once",
              flush=True)  # fmt: skip
        asyncio.run(
            run(
                settings, model, data_uri, n, work / "logs", parts,
                shard_size=args.shard_size, concurrent=args.concurrent_shards, every=args.every,
            )
        )  # fmt: skip
    finally:
        dev.down()

    finished(work)


if __name__ == "__main__":
    main()
