"""SIGTERM while a GPU worker loads its model stops the load: a scale-down, a deploy or
a spot notice can come before the pod is ready, and a real model's load holds its
memory for minutes. The worker says it stopped, exits 0, and none of its engine
processes is left loading on.

Real processes: ``llm-batch worker gpu`` (the console script) on the tiny model; the
signal goes to the worker's own pid once its engine's Worker process runs, as Kubernetes
sends it to a container's main process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from llmbatch.config import Settings
from tests.fixtures.worker_processes import (
    engine_tree,
    gpu_worker_process,
    stop_worker,
    until_group_gone,
)

pytestmark = pytest.mark.slow

# From the signal to the worker's exit, at most (a loaded 2-core machine included).
STOPS_WITHIN_S = 60


async def test_sigterm_while_the_model_loads_stops_the_load_and_leaves_no_engine(
    stack: Settings, model_name: str, tmp_path: Path
) -> None:
    log = tmp_path / "gpu-worker.log"
    proc = gpu_worker_process(stack, model_name, log)
    try:
        # EngineCore's Worker process names itself once it is set up, before it loads
        # the weights and sizes the KV cache: the signal comes in the middle of the load.
        for _ in range(3000):
            assert proc.poll() is None, proc.exit_message()
            if any(_named(p, "Worker") for p in engine_tree(proc.pid)):
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("no engine Worker process in 300 s")
        os.kill(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = await asyncio.wait_for(asyncio.to_thread(proc.wait), STOPS_WITHIN_S)
        exited_after = time.monotonic() - signalled
        left = await until_group_gone(proc, within_s=10)
        said = log.read_text(errors="replace")
    finally:
        stop_worker(proc)
    assert left == []
    assert code == 0, proc.exit_message(30)
    # It was still loading: it never polled.
    assert "polling" not in said
    assert "gpu worker stopped while starting (SIGTERM)" in said, proc.exit_message(30)
    print(f"the worker exited {exited_after:.1f} s after SIGTERM, its engine loading")


def _named(process: psutil.Process, name: str) -> bool:
    try:
        return name in process.name()
    except psutil.Error:
        return False
