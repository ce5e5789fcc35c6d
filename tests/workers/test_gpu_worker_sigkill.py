"""A GPU worker SIGKILLed (nothing of it runs: no shutdown, no finally) takes its vLLM
engine processes with it: an EngineCore left running, re-parented, would hold the
model's memory (on a GPU, its VRAM) and the restarted worker could not load.

Real processes: ``llm-batch worker gpu`` on the tiny model, and its own EngineCore
and Worker processes; only the worker's own pid is killed, not its process group."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil
from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.worker_processes import gpu_worker_process, stop_worker


async def test_a_sigkilled_gpu_worker_takes_its_engine_processes_with_it(
    stack: Settings, temporal_client: Client, model_name: str, tmp_path: Path
) -> None:
    proc = gpu_worker_process(stack, model_name, tmp_path / "gpu-worker.log")
    try:
        await wait_for_pollers(
            temporal_client, [stack.gpu_task_queue(model_name)], procs=[proc], within_s=300
        )
        engine = psutil.Process(proc.pid).children(recursive=True)
        names = [p.name() for p in engine]
        assert any("EngineCore" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)  # the worker alone, as the OOM killer does
        proc.wait()
        for _ in range(60):
            alive = [p for p in engine if _running(p)]
            if not alive:
                break
            await asyncio.sleep(0.5)
        assert [(p.pid, " ".join(p.cmdline())[:80]) for p in alive] == []
    finally:
        stop_worker(proc)


def _running(process: psutil.Process) -> bool:
    """Still there and not a zombie (a killed orphan stays one where PID 1 does not
    reap, as in some containers: it holds no memory)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
