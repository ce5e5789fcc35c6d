"""A GPU worker preempted mid-job, with and without drain: requests redone, wall time.

Starts an embedded stack of its own (free ports, a temporary state folder), the tiny
local model, one CPU worker and a GPU worker process, and runs a job of ``--rows``
rows (deduplication off, so every item is one engine request). When ``--at`` of the
items are done, the GPU worker gets SIGTERM, as Kubernetes sends it on a spot notice;
a second GPU worker is started at once and finishes the job. Run twice: once with
``--drain-timeout 0`` (what a worker did before drain: everything in flight aborted
and redone) and once with ``--drain-timeout`` (default 25 s, a GKE notice).

Printed per run: engine requests redone (the ledger's engine requests minus the
rows), how long the stopped worker took to exit, and the job's wall time.

    .venv/bin/python benchmarks/drain_preemption.py --rows 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from peer import finished

from llmbatch import ledger, storage
from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from llmbatch.devstack import DevStack, isolated_settings
from llmbatch.devstack.demo import settings_env, wait_for_pollers
from llmbatch.devstack.process import LoggedProcess
from llmbatch.devstack.tiny_model import build_tiny_model

# A fixed KV cache: a share of RAM fails on machines whose NUMA node 0 is small.
ENGINE_ARGS = [
    "--max-model-len", "512", "--max-num-seqs", "64", "--concurrent-shards", "2",
    "--kv-cache-memory-bytes", str(512 << 20),
]  # fmt: skip


@dataclass(frozen=True)
class Round:
    drain_timeout: float
    redone: int
    done_at_signal: int
    exit_s: float
    exit_code: int
    wall_s: float


def _worker(settings: Settings, args: list[str], log: Path) -> LoggedProcess:
    return LoggedProcess(
        [sys.executable, "-m", "llmbatch.cli.main", "worker", *args],
        log=log,
        env={**os.environ, **settings_env(settings)},
        new_session=True,
    )


async def one_round(
    settings: Settings, model: str, work: Path, *, rows: int, at: float, drain_timeout: float
) -> Round:
    client = await connect(settings)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    name = f"drain-{drain_timeout:g}-{uuid.uuid4().hex[:6]}"
    uri = f"s3://{settings.s3_bucket}/bench-drain/{name}.jsonl"
    body = "".join(json.dumps({"n": i}) + "\n" for i in range(rows))
    storage.stores.open_store(uri, settings).put_bytes(uri, body.encode())
    spec = JobSpec(
        job_id=name,
        inputs=[uri],
        messages=[ChatMessage(role="user", content="Tell me about {{ n }}.")],
        model=model,
        sampling=SamplingSpec(max_tokens=32, temperature=1.0),
        dedup=False,
        shard_size=500,
        max_concurrent_shards=2,
        output_uri=f"s3://{settings.s3_bucket}/bench-drain-out",
    )
    logs = work / "logs"
    gpu = ["gpu", "--model", model, *ENGINE_ARGS]
    first = _worker(settings, [*gpu, "--drain-timeout", str(drain_timeout)], logs / f"{name}-1.log")
    second = None
    try:
        await wait_for_pollers(
            client, [settings.gpu_task_queue(model)], procs=[first], within_s=600
        )
        started = time.monotonic()
        handle, _ = await start_job(client, spec, settings=settings)
        for _ in range(60_000):  # the ledger is the only outside view of progress
            done = (await ledger.jobs.job_counts(pool, job_id=name)).succeeded
            if done >= rows * at:
                break
            await asyncio.sleep(0.05)
        signalled = time.monotonic()
        first.send_signal(signal.SIGTERM)
        # The replacement starts at once, as a new pod would; it polls once loaded.
        second = _worker(settings, gpu, logs / f"{name}-2.log")
        exit_code = await asyncio.to_thread(first.wait, drain_timeout + 120)
        exit_s = time.monotonic() - signalled
        summary = await handle.result()
        wall_s = time.monotonic() - started
        usage = await ledger.usage.usage(pool, job_id=name)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
        await pool.close()
    assert summary.items_succeeded == rows, summary
    return Round(drain_timeout, usage.engine_requests - rows, done, exit_s, exit_code, wall_s)


async def bench(args: argparse.Namespace, settings: Settings, model: str, work: Path) -> None:
    rounds = []
    for drain_timeout in (0.0, args.drain_timeout):
        async with _cpu_worker(settings, work):
            rounds.append(
                await one_round(
                    settings, model, work, rows=args.rows, at=args.at, drain_timeout=drain_timeout
                )
            )
    print(f"\n{args.rows} rows, 32 tokens each; GPU worker SIGTERMed at {args.at:.0%} done")
    for r in rounds:
        label = "no drain" if r.drain_timeout == 0 else f"drain {r.drain_timeout:g} s"
        print(
            f"  {label:12} {r.done_at_signal} done at SIGTERM; requests redone {r.redone}; "
            f"worker exited {r.exit_s:.1f} s after (code {r.exit_code}); job wall time "
            f"{r.wall_s:.1f} s"
        )


class _cpu_worker:
    """``llm-batch worker cpu`` for the length of a round."""

    def __init__(self, settings: Settings, work: Path) -> None:
        self._settings, self._work = settings, work
        self._proc: LoggedProcess | None = None

    async def __aenter__(self) -> None:
        self._proc = _worker(self._settings, ["cpu"], self._work / "logs" / "cpu.log")

    async def __aexit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(self._proc.wait, 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--at", type=float, default=0.3, help="fraction done at SIGTERM")
    parser.add_argument("--drain-timeout", type=float, default=25.0)
    parser.add_argument("--model", help="model path; default the tiny local model")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmbatch-bench-drain-"))
    (work / "logs").mkdir()
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
