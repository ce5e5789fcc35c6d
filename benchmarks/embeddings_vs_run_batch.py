"""Embeddings: llm-batch against ``vllm run-batch`` on the same /v1/embeddings file.

In one run: the same OpenAI batch file of ``--requests`` /v1/embeddings lines (20,000
by default) through ``vllm run-batch`` and through llm-batch on the embedded stack,
with the same engine options (vLLM's pooling runner on the same model), alternating
``--repeats`` times; items/s of both (engine load excluded, as in
throughput_vs_run_batch.py), the ratio of medians, and each one's peak RSS (the
process and all its children, sampled every 0.2 s; for llm-batch the CPU and the
embedding worker together). Then llm-batch alone on ``--large`` rows (200,000): its
workers' peak RSS against the one at ``--requests`` rows, to show memory stays flat
(vectors are staged in the object store shard by shard, never held for the job).

Both engines run in the same process environment (benchmarks/peer.py says which).

    .venv/bin/python benchmarks/embeddings_vs_run_batch.py --requests 20000 --large 200000
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
from pathlib import Path
from typing import Any

# benchmarks/peer.py: a script's own folder is on its import path.
from peer import TOPICS, PeakRss, finished, run_batch
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobSummary
from llmbatch.contract.spec import InputFormat, JobSpec, Task
from llmbatch.devstack import DevStack
from llmbatch.devstack.demo import wait_for_pollers, worker_processes
from llmbatch.devstack.tiny_model import build_tiny_model
from llmbatch.engine.cpu import cpu_engine_env

# The same engine for both: the pooling runner, the tiny decoder made an embedder.
ENGINE_ARGS = [
    "--runner", "pooling", "--convert", "embed", "--dtype", "float32",
    "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "256",
    # A fixed KV cache, as the tests' engine has: vLLM allocates it at start but its
    # pages count in RSS only once touched, and the engine cycles through its blocks,
    # so a cache of a RAM share (2.4 GB at 0.1 here) shows as "growth" over a long run
    # that is only the cache being touched for the first time.
    "--kv-cache-memory-bytes", "512M",
]  # fmt: skip


def batch_lines(n: int, *, model: str) -> bytes:
    lines = []
    for i in range(n):
        text = (
            f"Document {i} is about {TOPICS[i % len(TOPICS)]}. It was written for "
            f"readers of issue {i % 97} and mentions {TOPICS[(i * 7) % len(TOPICS)]} too."
        )
        body = {"model": model, "input": text}
        lines.append(
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            )
        )
    return ("\n".join(lines) + "\n").encode()


async def llm_batch(
    settings: Settings, model: str, data_uri: str, n: int, log_dir: Path
) -> tuple[float, int]:
    """(seconds for the job, the workers' peak RSS during it); each worker's own peak
    (the GPU worker's with its engine processes) is printed too."""
    client = await connect(settings)
    gpu_args = [*ENGINE_ARGS, "--task", Task.EMBED.value]
    with worker_processes(settings, model, log_dir=log_dir, gpu_args=gpu_args) as procs:
        await wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model, Task.EMBED)],
            procs=procs,
            within_s=900,
        )
        spec = JobSpec(
            job_id=f"bench-embed-{uuid.uuid4().hex[:8]}",
            task=Task.EMBED,
            inputs=[data_uri],
            input_format=InputFormat.OPENAI,
            model=model,
            output_uri=f"s3://{settings.s3_bucket}/bench-out",
            shard_size=1000,
            max_concurrent_shards=4,
        )
        with PeakRss([p.pid for p in procs]) as rss:
            started = time.monotonic()
            handle, _ = await start_job(client, spec, settings=settings)
            summary = await _result(handle)
            elapsed = time.monotonic() - started
    assert summary.items_succeeded == n, summary
    print(f"  llm-batch: {elapsed:.1f} s, {summary.items_succeeded} ok, workers' peak RSS "
          f"{rss.peak / 2**30:.2f} GiB ({rss.describe(['cpu worker', 'gpu worker'])} GiB)",
          flush=True)  # fmt: skip
    return elapsed, rss.peak


async def _result(handle: WorkflowHandle[Any, JobSummary]) -> JobSummary:
    # A long poll that times out on a loaded machine is polled again.
    while True:
        try:
            return await handle.result()
        except RPCError as exc:
            if exc.status is not RPCStatusCode.DEADLINE_EXCEEDED:
                raise


def upload(settings: Settings, work: Path, n: int, model: str) -> tuple[Path, str]:
    src = work / f"batch-{n}.jsonl"
    src.write_bytes(batch_lines(n, model=model))
    data_uri = f"s3://{settings.s3_bucket}/bench/embeddings-{n}.jsonl"
    storage.stores.open_store(data_uri, settings).put_file(data_uri, src)
    return src, data_uri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--large", type=int, default=200_000, help="0: skip the memory run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", help="model path; default the tiny local model")
    parser.add_argument(
        "--no-peer", action="store_true", help="skip run-batch (llm-batch's memory run only)"
    )
    args = parser.parse_args()

    settings = Settings()
    DevStack(settings).up()
    work = Path(tempfile.mkdtemp(prefix="llmbatch-bench-embed-"))
    model = args.model or str(
        build_tiny_model(settings.state_dir.resolve() / "models" / "tiny-llama")
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    n = args.requests
    src, data_uri = upload(settings, work, n, model)

    peer_s, peer_rss, ours_s, ours_rss = [], [], [], []
    for round_ in range(args.repeats):
        print(f"round {round_ + 1}/{args.repeats}", flush=True)
        if not args.no_peer:
            # What llm-batch's embedding worker gives its engine's processes.
            peer = run_batch(model, src, work / "out.jsonl", ENGINE_ARGS, env=cpu_engine_env())
            peer_s.append(peer.batch_s)
            peer_rss.append(peer.peak_rss)
        seconds, rss = asyncio.run(llm_batch(settings, model, data_uri, n, work / "logs"))
        ours_s.append(seconds)
        ours_rss.append(rss)

    med = statistics.median
    gib = 2**30
    ours = n / med(ours_s)
    print(f"\n{n} /v1/embeddings requests, {args.repeats} round(s), medians:")
    if peer_s:
        peer = n / med(peer_s)
        print(f"  run-batch  {peer:8.1f} items/s   peak RSS {med(peer_rss) / gib:.2f} GiB")
    print(f"  llm-batch  {ours:8.1f} items/s   peak RSS {med(ours_rss) / gib:.2f} GiB (workers)")
    if peer_s:
        print(f"  ratio llm-batch / run-batch: {ours / peer:.2f}x items/s", flush=True)

    if args.large:
        _, large_uri = upload(settings, work, args.large, model)
        seconds, rss = asyncio.run(
            llm_batch(settings, model, large_uri, args.large, work / "logs-large")
        )
        small = med(ours_rss)
        print(f"\nllm-batch alone on {args.large} rows: {args.large / seconds:.1f} items/s")
        print(f"  workers' peak RSS: {small / gib:.2f} GiB at {n} rows, {rss / gib:.2f} GiB at "
              f"{args.large} rows ({(rss / small - 1) * 100:+.1f}%)")  # fmt: skip

    finished(work)


if __name__ == "__main__":
    main()
