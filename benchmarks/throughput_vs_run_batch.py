"""llm-batch against ``vllm run-batch`` on the same OpenAI batch file, model and machine.

Runs the peer (``python -m vllm.entrypoints.openai.run_batch``) and llm-batch on the
embedded stack with the same engine options, alternating, ``--repeats`` times each,
and prints items/s for both (engine load excluded and included) and the ratio of
medians. Engine load is split off the same way for both: for run-batch, until it logs
that it reads the batch file; for llm-batch, until the started workers poll their queues.

With ``--api``, each round also sends the same file through the OpenAI Batch API
(``llm-batch serve`` on the same workers, with the official client: upload, create,
poll, download the output file), timed from the upload's start to the output's last
byte, and prints its items/s against the job submitted directly and against run-batch.

    .venv/bin/python benchmarks/throughput_vs_run_batch.py --requests 5000 --repeats 3 --api
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

# benchmarks/peer.py: a script's own folder is on its import path.
from peer import chat_lines, run_batch

from llmbatch import storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import JobSpec
from llmbatch.devstack import DevStack
from llmbatch.devstack.demo import wait_for_pollers, worker_processes
from llmbatch.devstack.tiny_model import build_tiny_model

# The KV cache in bytes (256 sequences of 512 tokens need ~270 MB with the tiny model):
# on CPU a --gpu-memory-utilization share is of one memory node, which on some machines
# holds a fraction of the RAM, so a share that works on one machine fails on another.
ENGINE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "256",
    "--kv-cache-memory-bytes", str(512 << 20),
]  # fmt: skip


def _serve(settings: Settings, port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    from llmbatch.devstack.demo import settings_env

    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "serve.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "llmbatch.cli.main", "serve", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **settings_env(settings)},
        )  # fmt: skip


async def through_api(settings: Settings, src: Path, n: int, log_dir: Path) -> float:
    """Seconds from the upload's start to the output file downloaded, through
    ``llm-batch serve`` and the official client, on the workers already polling."""
    import openai

    from llmbatch import ledger
    from llmbatch.api.auth import create_key
    from llmbatch.devstack.process import free_port

    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=1)
    try:
        key = (await create_key(pool, project="bench")).secret
    finally:
        await pool.close()
    port = free_port()
    server = _serve(settings, port, log_dir)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600
        )
        while True:  # until it answers
            try:
                await client.models.list()
                break
            except openai.APIConnectionError:
                await asyncio.sleep(0.2)
        began = time.monotonic()
        with src.open("rb") as f:
            uploaded = await client.files.create(file=("batch.jsonl", f), purpose="batch")
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.2)
            batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id, batch
        ok = 0
        async with client.files.with_streaming_response.content(batch.output_file_id) as r:
            async for line in r.iter_lines():
                ok += bool(line.strip())
        elapsed = time.monotonic() - began
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert ok == n, (ok, n)
    print(f"  API:       {elapsed:.1f} s upload to output downloaded, {ok} ok", flush=True)
    return elapsed


async def llm_batch(
    settings: Settings, model: str, data_uri: str, n: int, log_dir: Path, *, api: Path | None
) -> tuple[float, float, float | None]:
    client = await connect(settings)
    gpu_args = list(ENGINE_ARGS)
    started = time.monotonic()
    with worker_processes(settings, model, log_dir=log_dir, gpu_args=gpu_args) as procs:
        await wait_for_pollers(
            client,
            [settings.cpu_task_queue, settings.gpu_task_queue(model)],
            procs=procs,
            within_s=600,
        )
        load = time.monotonic() - started
        spec = JobSpec(
            job_id=f"bench-{uuid.uuid4().hex[:8]}",
            inputs=[data_uri],
            model=model,
            output_uri=f"s3://{settings.s3_bucket}/bench-out",
            shard_size=1000,
            max_concurrent_shards=4,
        )
        job_started = time.monotonic()
        handle, _ = await start_job(client, spec, settings=settings)
        summary = await handle.result()
        elapsed = time.monotonic() - job_started
        assert summary.items_succeeded == n, summary
        print(
            f"  llm-batch: {elapsed:.1f} s job + {load:.1f} s worker start, "
            f"{summary.items_succeeded} ok",
            flush=True,
        )
        api_s = await through_api(settings, api, n, log_dir) if api is not None else None
    return elapsed, load, api_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="model path; default the tiny local model")
    parser.add_argument(
        "--api", action="store_true", help="Also send the file through the OpenAI Batch API."
    )
    args = parser.parse_args()

    settings = Settings()
    DevStack(settings).up()
    work = Path(tempfile.mkdtemp(prefix="llmbatch-bench-"))
    model = args.model or str(
        build_tiny_model(settings.state_dir.resolve() / "models" / "tiny-llama")
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = work / "batch.jsonl"
    src.write_bytes(chat_lines(args.requests, model=model, max_tokens=args.max_tokens))
    data_uri = f"s3://{settings.s3_bucket}/bench/batch-{args.requests}.jsonl"
    storage.stores.open_store(data_uri, settings).put_file(data_uri, src)

    peer_job, peer_load, ours_job, ours_load, api_job = [], [], [], [], []
    for round_ in range(args.repeats):
        print(f"round {round_ + 1}/{args.repeats}", flush=True)
        peer = run_batch(model, src, work / "out.jsonl", ENGINE_ARGS)
        peer_job.append(peer.batch_s)
        peer_load.append(peer.load_s)
        job, load, api_s = asyncio.run(
            llm_batch(
                settings, model, data_uri, args.requests, work / "logs",
                api=src if args.api else None,
            )
        )  # fmt: skip
        ours_job.append(job)
        ours_load.append(load)
        if api_s is not None:
            api_job.append(api_s)

    n = args.requests
    med = statistics.median
    peer_excl = n / med(peer_job)
    peer_incl = n / (med(peer_job) + med(peer_load))
    ours_excl = n / med(ours_job)
    ours_incl = n / (med(ours_job) + med(ours_load))
    print(f"\n{n} requests, {args.max_tokens} max tokens, {args.repeats} rounds, medians:")
    print(f"  run-batch  excl. load {peer_excl:8.1f} items/s   incl. load {peer_incl:8.1f} items/s")
    print(f"  llm-batch  excl. load {ours_excl:8.1f} items/s   incl. load {ours_incl:8.1f} items/s")
    print(f"  ratio llm-batch / run-batch: excl. load {ours_excl / peer_excl:.2f}x, "
          f"incl. load {ours_incl / peer_incl:.2f}x")  # fmt: skip
    if api_job:
        api_excl = n / med(api_job)
        print(f"  API        excl. load {api_excl:8.1f} items/s   (upload to output downloaded)")
        print(f"  ratio API / llm-batch submit: {api_excl / ours_excl:.2f}x, "
              f"API / run-batch: {api_excl / peer_excl:.2f}x (excl. load)")  # fmt: skip


if __name__ == "__main__":
    main()
