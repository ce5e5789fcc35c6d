"""llm-batch against ``vllm run-batch`` and vLLM's in-process ``AsyncLLM`` loop on the
same OpenAI batch file, model and machine.

Runs the two peers (``python -m vllm.entrypoints.openai.run_batch``, and the loop of
benchmarks/peer.py: one ``AsyncLLM``, vLLM's own chat rendering, ``generate()``
generators) and llm-batch on the embedded stack with the same engine options, one after
the other in each round (the first of them changing from round to round), ``--repeats``
rounds, and prints items/s of each (engine load excluded and included) and the ratios
of medians against both peers. Engine load is split off the same way for all: for the
peers, until they log that they read the batch file (their batch ends when they write
their output, before their engine's shutdown; the time to exit is printed too); for
llm-batch, until the started workers poll their queues. Each figure's line says the
machine's load. ``--timeline`` prints each llm-batch job's timeline from its Temporal
histories (benchmarks/timeline.py): where the job's time goes that is not engine work;
``--profile DIR`` records the workers (and the engine's processes) with py-spy in one
more llm-batch job in the last round, not among the figures.

With ``--api``, each round also sends the same file through the OpenAI Batch API
(``llm-batch serve`` on the same workers, with the official client: upload, create,
poll, download the output file), timed from the upload's start to the output's last
byte, and prints its items/s against the job submitted directly and against run-batch.

    .venv/bin/python benchmarks/throughput_vs_run_batch.py --requests 5000 --repeats 3 --api
    .venv/bin/python benchmarks/throughput_vs_run_batch.py --requests 5000 --timeline
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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

# benchmarks/peer.py: a script's own folder is on its import path.
from peer import (
    PeerRun,
    asyncllm_loop,
    chat_lines,
    cpu_seconds,
    finished,
    load,
    profiled,
    run_batch,
)
from timeline import job_timeline

from llmbatch import storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
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
    settings: Settings,
    model: str,
    data_uri: str,
    n: int,
    log_dir: Path,
    *,
    api: Path | None,
    timeline: bool,
    parts: dict[str, int],
    profile: Path | None = None,
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
        load_s = time.monotonic() - started
        # The job spec's defaults (shard size, window): what a user gets.
        spec = JobSpec(
            job_id=f"bench-{uuid.uuid4().hex[:8]}",
            inputs=[data_uri],
            model=model,
            output_uri=f"s3://{settings.s3_bucket}/bench-out",
        )
        cpu, gpu = procs
        # CPU seconds over the job of each process: the GPU worker's own process apart
        # from its engine's (its descendants), the stack's parts with theirs.
        watched = {"cpu worker": (cpu.pid, True), "gpu worker": (gpu.pid, False)}
        watched |= {name: (pid, True) for name, pid in parts.items()}

        def cpu_now() -> dict[str, float]:
            now = {name: cpu_seconds(pid, descendants=d) for name, (pid, d) in watched.items()}
            now["engine processes"] = cpu_seconds(gpu.pid) - now["gpu worker"]
            return now

        before = cpu_now()
        submitted = datetime.now(UTC)
        job_started = time.monotonic()
        handle, _ = await start_job(client, spec, settings=settings)
        summary = await handle.result()
        elapsed = time.monotonic() - job_started
        seen_end = datetime.now(UTC)
        after = cpu_now()
        assert summary.items_succeeded == n, summary
        print("    CPU s over the job: " + ", ".join(
            f"{name} {after[name] - before[name]:.1f}" for name in after), flush=True)  # fmt: skip
        if profile is not None:
            # One more job, not among the figures: py-spy takes CPU of its own.
            with profiled({"cpu worker": (cpu.pid, True), "gpu worker": (gpu.pid, True)}, profile):
                again = spec.model_copy(update={"job_id": f"{spec.job_id}-profiled"})
                await (await start_job(client, again, settings=settings))[0].result()
        print(
            f"  llm-batch: {elapsed:.1f} s job + {load_s:.1f} s worker start, "
            f"{summary.items_succeeded} ok (load {load()})",
            flush=True,
        )
        if timeline:
            print(
                await job_timeline(
                    client,
                    spec.job_id,
                    shards=summary.shards_total,
                    submitted=submitted,
                    seen_end=seen_end,
                ),
                flush=True,
            )
        api_s = await through_api(settings, api, n, log_dir) if api is not None else None
    return elapsed, load_s, api_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="model path; default the tiny local model")
    parser.add_argument(
        "--api", action="store_true", help="Also send the file through the OpenAI Batch API."
    )
    parser.add_argument(
        "--timeline", action="store_true", help="Print each llm-batch job's timeline."
    )
    parser.add_argument(
        "--profile", type=Path, help="record the workers with py-spy in one more llm-batch job"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmbatch-bench-"))
    # A stack of its own (free ports, its own state): never a developer's `dev up`.
    settings = isolated_settings(work / "stack")
    dev = DevStack(settings)
    dev.up()
    try:
        parts = {p.name: p.pid for p in dev.status().parts if p.pid is not None}
        _rounds(args, settings, work, parts)
    finally:
        dev.down()
    finished(work)


def _rounds(
    args: argparse.Namespace, settings: Settings, work: Path, parts: dict[str, int]
) -> None:
    model = args.model or str(build_tiny_model(work / "models" / "tiny-llama"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = work / "batch.jsonl"
    src.write_bytes(chat_lines(args.requests, model=model, max_tokens=args.max_tokens))
    data_uri = f"s3://{settings.s3_bucket}/bench/batch-{args.requests}.jsonl"
    storage.stores.open_store(data_uri, settings).put_file(data_uri, src)

    n = args.requests
    # Seconds on the batch and seconds of engine load, per round, by runner.
    job: dict[str, list[float]] = {"run-batch": [], "AsyncLLM loop": [], "llm-batch": []}
    loads: dict[str, list[float]] = {name: [] for name in job}
    api_job: list[float] = []
    # The peers' seconds to their process's exit (their engine's shutdown too).
    exits: dict[str, list[float]] = {"run-batch": [], "AsyncLLM loop": []}

    def peer(run: Callable[..., PeerRun], name: str) -> Callable[[], None]:
        def go() -> None:
            result = run(model, src, work / "out.jsonl", ENGINE_ARGS)
            assert result.ok == n, (name, result)
            print(f"    (load {load()})", flush=True)
            job[name].append(result.batch_s)
            loads[name].append(result.load_s)
            exits[name].append(result.exit_s)

        return go

    def ours() -> None:
        elapsed, load_s, api_s = asyncio.run(
            llm_batch(
                settings, model, data_uri, n, work / "logs",
                api=src if args.api else None, timeline=args.timeline, parts=parts,
                profile=args.profile if len(job["llm-batch"]) == args.repeats - 1 else None,
            )
        )  # fmt: skip
        job["llm-batch"].append(elapsed)
        loads["llm-batch"].append(load_s)
        if api_s is not None:
            api_job.append(api_s)

    runners = [peer(run_batch, "run-batch"), peer(asyncllm_loop, "AsyncLLM loop"), ours]
    for round_ in range(args.repeats):
        print(f"round {round_ + 1}/{args.repeats} (load {load()})", flush=True)
        # Each round starts with another runner: none is always first or last.
        shift = round_ % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner()

    med = statistics.median
    excl = {name: n / med(job[name]) for name in job}
    incl = {name: n / (med(job[name]) + med(loads[name])) for name in job}
    print(f"\n{n} requests, {args.max_tokens} max tokens, {args.repeats} rounds, medians "
          f"(load now {load()}):")  # fmt: skip
    for name in job:
        print(f"  {name:14s} excl. load {excl[name]:8.1f} items/s   "
              f"incl. load {incl[name]:8.1f} items/s")  # fmt: skip
    for name, seconds in exits.items():
        print(f"  ({name} to its exit, engine shutdown included: {n / med(seconds):.1f} items/s)")
    for name in ("run-batch", "AsyncLLM loop"):
        print(f"  ratio llm-batch / {name}: excl. load {excl['llm-batch'] / excl[name]:.2f}x, "
              f"incl. load {incl['llm-batch'] / incl[name]:.2f}x")  # fmt: skip
    if api_job:
        api_excl = n / med(api_job)
        print(
            f"  API            excl. load {api_excl:8.1f} items/s   (upload to output downloaded)"
        )
        print(f"  ratio API / llm-batch submit: {api_excl / excl['llm-batch']:.2f}x, "
              f"API / run-batch: {api_excl / excl['run-batch']:.2f}x (excl. load)")  # fmt: skip


if __name__ == "__main__":
    main()
