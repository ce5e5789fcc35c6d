"""SIGTERM to a real CPU worker process while a template runs away: it exits at once.

The worker runs as ``llm-batch worker cpu`` on a CPU queue of its own, with a row time
limit of ten minutes, so only the worker's own stop can end the render: it must kill
its render process, not wait for the template.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from temporalio.client import Client

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.devstack.demo import wait_for_pollers
from tests.activities.test_render_runaway import poisoned_job, render_running, row
from tests.fixtures.worker_processes import cpu_worker_process, stop_worker

pytestmark = pytest.mark.slow


def render_children(worker: psutil.Process) -> list[psutil.Process]:
    return [
        p
        for p in worker.children(recursive=True)
        if "llmbatch.rendering.pool" in " ".join(p.cmdline())
    ]


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_sigterm_during_a_runaway_render_stops_the_worker_within_seconds(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    # No drain: a worker with a drain timeout waits that long for a render to end
    # before it cancels it (a render that never ends takes the whole drain timeout).
    own = workers.model_copy(
        update={
            "cpu_task_queue": f"cpu-runaway-{uuid.uuid4().hex[:8]}",
            "render_timeout_s": 600,
            "drain_timeout": timedelta(0),
        }
    )
    spec = poisoned_job(tmp_path, [row("ok-0", "ok", 1), row("loop", "loop", 100_000)], model_name)
    proc = cpu_worker_process(own, tmp_path / "cpu.log")
    handle = None
    try:
        await wait_for_pollers(temporal_client, [own.cpu_task_queue], procs=[proc], within_s=120)
        handle, _ = await start_job(temporal_client, spec, settings=own)
        worker = psutil.Process(proc.pid)
        for _ in range(1200):
            if await render_running(temporal_client, spec.job_id) and render_children(worker):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the render never started")
        [child] = render_children(worker)
        await asyncio.sleep(2)  # well into the runaway row
        assert child.is_running() and child.cpu_percent(interval=0.5) > 10

        proc.send_signal(signal.SIGTERM)  # the worker alone, not its process group
        signalled = time.monotonic()
        code = await asyncio.to_thread(proc.wait, 30)
        took = time.monotonic() - signalled
    finally:
        if handle is not None:
            await handle.terminate("test over")
        stop_worker(proc)

    assert code == 0, (tmp_path / "cpu.log").read_text()[-3000:]
    assert took < 5, f"the worker took {took:.1f} s to stop"
    assert gone(child)
    print(f"\nCPU worker stopped {took:.2f} s after SIGTERM, mid-render")
