"""Repeated requests: ``vllm run-batch`` against llm-batch with deduplication, and a
second llm-batch job on the same input answered from the result cache.

One run on one machine with the same engine options: a chat batch file of
``--requests`` lines in which each distinct request appears ``--repeat`` times
(greedy, so deduplication applies). Prints items/s of the three (engine load
excluded for all) and their ratios, and for the cached job, which needs no engine
work at all, the CPU time per item of each process of llm-batch's control plane:
the CPU worker, the GPU worker's own process (not its engine's), Postgres,
Temporal and the object store, from /proc/<pid>/stat before and after the job
(each process with its descendants), and beside each what the same process spends
idle in as long (its pollers and timers, measured on the idle stack after the
rounds). The deduplicated job gets the same split, per item of the job: there the
engine's own processes (vLLM's engine core, which generates the distinct requests)
are not control plane and are printed apart, while the GPU worker's own process
(vLLM's front end with our activity: tokenizing, detokenizing, the ledger) is.
The llm-batch jobs run ``--repeats`` times and the figures are medians; each line
says the machine's load. ``--profile DIR`` records
the CPU and GPU workers with py-spy (collapsed stacks) in one more cached round.

    .venv/bin/python benchmarks/dedup_cache.py --requests 20000 --repeat 20
    .venv/bin/python benchmarks/dedup_cache.py --requests 20000 --repeat 20 --profile prof/
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

# benchmarks/peer.py: a script's own folder is on its import path.
from peer import chat_lines, cpu_seconds, finished, load, profiled, run_batch

from llmbatch import storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobSummary
from llmbatch.contract.spec import JobSpec
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.devstack.demo import wait_for_pollers, worker_processes
from llmbatch.devstack.tiny_model import build_tiny_model

# The KV cache in bytes (256 sequences of 512 tokens need ~270 MB with the tiny model):
# on CPU a --gpu-memory-utilization share is of one memory node, which on some machines
# holds a fraction of the RAM, so a share that works on one machine fails on another.
ENGINE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "256",
    "--kv-cache-memory-bytes", str(512 << 20),
]  # fmt: skip
# Rows per shard (--shard-size; default the job spec's): Temporal's and each step's
# fixed costs are per shard, so per item they fall as shards grow.
SHARD_SIZE = JobSpec.model_fields["shard_size"].default
# Seconds of an idle stack measured after the rounds, for each process's background.
IDLE_S = 15.0
# The split's row for the GPU worker's engine processes, which are not control plane,
# and its row for the control plane's sum.
ENGINE = "the GPU worker's engine processes"
TOTAL = "total (median of sums)"


async def run_job(
    client: object, settings: Settings, model: str, data_uri: str, *, cache: bool
) -> tuple[JobSummary, float]:
    spec = JobSpec(
        job_id=f"bench-{'cache' if cache else 'dedup'}-{uuid.uuid4().hex[:8]}",
        inputs=[data_uri],
        model=model,
        output_uri=f"s3://{settings.s3_bucket}/bench-out",
        shard_size=SHARD_SIZE,
        max_concurrent_shards=4,
        cache=cache,
    )
    started = time.monotonic()
    handle, _ = await start_job(client, spec, settings=settings)  # type: ignore[arg-type]
    summary: JobSummary = await handle.result()
    return summary, time.monotonic() - started


async def llm_batch(
    settings: Settings,
    model: str,
    data_uri: str,
    n: int,
    log_dir: Path,
    parts: dict[str, int],
    *,
    repeats: int,
    profile: Path | None,
) -> dict[str, object]:
    client = await connect(settings)
    with worker_processes(settings, model, log_dir=log_dir, gpu_args=list(ENGINE_ARGS)) as procs:
        await wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model)],
            procs=procs,
            within_s=900,
        )
        cpu, gpu = procs
        watched = {"cpu worker": (cpu.pid, True), "gpu worker (own process)": (gpu.pid, False)}
        watched |= {name: (pid, True) for name, pid in parts.items()}

        def sample() -> dict[str, float]:
            """CPU seconds so far of each watched process, and of the GPU worker's
            engine processes (its descendants) as ``ENGINE``."""
            now = {name: cpu_seconds(pid, descendants=d) for name, (pid, d) in watched.items()}
            return now | {ENGINE: cpu_seconds(gpu.pid) - now["gpu worker (own process)"]}

        def per_item(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
            return {k: (after[k] - before[k]) * 1000.0 / n for k in before}

        dedup_runs: list[float] = []
        dedup_splits: list[dict[str, float]] = []
        dedup_requests = 0
        for _ in range(repeats):
            before = sample()
            dedup, dedup_s = await run_job(client, settings, model, data_uri, cache=False)
            split = per_item(before, sample())
            assert dedup.items_succeeded == n, dedup
            dedup_runs.append(dedup_s)
            dedup_splits.append(split)
            dedup_requests = dedup.usage.engine_requests
            print(f"  llm-batch dedup: {dedup_s:.1f} s, {dedup.usage.describe()}, "
                  f"{_control_plane(split):.3f} CPU-ms per item outside the engine "
                  f"(load {load()})", flush=True)  # fmt: skip
        cached_runs: list[float] = []
        cached_splits: list[dict[str, float]] = []
        cached_requests = 0
        # The first cached run fills the cache (the dedup jobs did not write to it);
        # the measured ones after it are answered from it alone.
        await run_job(client, settings, model, data_uri, cache=True)
        for round_ in range(repeats + (profile is not None)):
            # The profiled round comes last and is not among the figures: py-spy
            # takes CPU of its own while it samples.
            spy = profile if round_ == repeats else None
            before = sample()
            with profiled({k: v for k, v in watched.items() if "worker" in k}, spy):
                cached, cached_s = await run_job(client, settings, model, data_uri, cache=True)
            split = per_item(before, sample())
            assert cached.items_succeeded == n, cached
            print(f"  llm-batch cached: {cached_s:.1f} s, {cached.usage.describe()}, "
                  f"{_control_plane(split):.3f} CPU-ms per item (load {load()})"
                  + (" [profiled]" if spy else ""), flush=True)  # fmt: skip
            if spy is None:
                cached_runs.append(cached_s)
                cached_splits.append(split)
                cached_requests = cached.usage.engine_requests
        # The stack's own background (pollers, timers, the dev server's housekeeping),
        # which the per-item figures include for as long as a job runs.
        before = {name: cpu_seconds(pid, descendants=d) for name, (pid, d) in watched.items()}
        await asyncio.sleep(IDLE_S)
        after = {name: cpu_seconds(pid, descendants=d) for name, (pid, d) in watched.items()}
    return {
        "idle_cpu_per_s": {k: (after[k] - before[k]) / IDLE_S for k in watched},
        "dedup_s": statistics.median(dedup_runs),
        "cached_s": statistics.median(cached_runs),
        "cached_requests": cached_requests,
        "dedup_requests": dedup_requests,
        "dedup_split": _medians(dedup_splits),
        "cached_split": _medians(cached_splits),
    }


def _control_plane(split: dict[str, float]) -> float:
    """The sum of a round's split over the control plane's processes (all but the
    engine's own)."""
    return sum(ms for name, ms in split.items() if name != ENGINE)


def _medians(splits: list[dict[str, float]]) -> dict[str, float]:
    """Each process's median over the rounds, and ``TOTAL``: the median of the
    rounds' control-plane sums (not the sum of the medians)."""
    medians = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return medians | {TOTAL: statistics.median(_control_plane(s) for s in splits)}


def _print_split(
    title: str, split: dict[str, float], idle_rate: dict[str, float], *, job_s: float, n: int
) -> None:
    """A round's per-item split, beside each process what it spends idle in as long
    as the job took."""
    print(f"  {title}")
    print("  (median of each; of it, the same process idle for the job's time, measured")
    print(f"  for {IDLE_S:.0f} s after the rounds):")
    idle = {k: rate * job_s * 1000.0 / n for k, rate in idle_rate.items()}
    for name, rate in idle.items():
        print(f"    {name:28s} {split[name]:7.3f}   idle {rate:6.3f}")
    print(f"    {TOTAL:28s} {split[TOTAL]:7.3f}   idle {sum(idle.values()):6.3f}")
    print(f"    ({ENGINE}: {split[ENGINE]:.3f})")


def main() -> None:
    global SHARD_SIZE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=20, help="times each request appears")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", help="model path; default the tiny local model")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each llm-batch job")
    parser.add_argument(
        "--shard-size", type=int, default=SHARD_SIZE, help="rows per shard (default: growing)"
    )
    parser.add_argument(
        "--profile", type=Path, help="record the workers with py-spy in one more cached round"
    )
    args = parser.parse_args()
    SHARD_SIZE = args.shard_size

    work = Path(tempfile.mkdtemp(prefix="llmbatch-dedup-bench-"))
    settings = isolated_settings(work / "stack")
    dev = DevStack(settings)
    dev.up()
    try:
        parts = {f"{p.name}": p.pid for p in dev.status().parts if p.pid is not None}
        model = args.model or str(build_tiny_model(work / "models" / "tiny-llama"))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        n = args.requests
        src = work / "batch.jsonl"
        src.write_bytes(chat_lines(n, model=model, max_tokens=args.max_tokens, repeat=args.repeat))
        data_uri = f"s3://{settings.s3_bucket}/bench/batch-{n}.jsonl"
        storage.stores.open_store(data_uri, settings).put_file(data_uri, src)

        print(f"{n} requests, each distinct one {args.repeat} times", flush=True)
        peer_s = run_batch(model, src, work / "out.jsonl", ENGINE_ARGS).batch_s
        print(f"  run-batch: {peer_s:.1f} s (load {load()})", flush=True)
        ours = asyncio.run(
            llm_batch(
                settings, model, data_uri, n, work / "logs", parts,
                repeats=args.repeats, profile=args.profile,
            )
        )  # fmt: skip
    finally:
        dev.down()

    peer, dedup = n / peer_s, n / float(ours["dedup_s"])  # type: ignore[arg-type]
    cached = n / float(ours["cached_s"])  # type: ignore[arg-type]
    print(f"\n{n} requests ({n // args.repeat} distinct), {args.max_tokens} max tokens, "
          f"{args.shard_size or 'growing'} rows per shard, "
          f"medians of {args.repeats} llm-batch rounds, "
          f"load now {load()}:")  # fmt: skip
    print(f"  run-batch               {peer:8.1f} items/s")
    print(f"  llm-batch dedup         {dedup:8.1f} items/s   {dedup / peer:5.2f}x run-batch "
          f"({ours['dedup_requests']} engine requests)")  # fmt: skip
    print(f"  llm-batch cached re-run {cached:8.1f} items/s   {cached / peer:5.2f}x run-batch "
          f"({ours['cached_requests']} engine requests)")  # fmt: skip
    idle_rate: dict[str, float] = ours["idle_cpu_per_s"]  # type: ignore[assignment]
    for title, run in (
        ("CPU ms per item of the deduplicated job, outside the engine:", "dedup"),
        ("CPU ms per item of the cached re-run:", "cached"),
    ):
        split: dict[str, float] = ours[f"{run}_split"]  # type: ignore[assignment]
        job_s = float(ours[f"{run}_s"])  # type: ignore[arg-type]
        _print_split(title, split, idle_rate, job_s=job_s, n=n)

    finished(work)


if __name__ == "__main__":
    main()
