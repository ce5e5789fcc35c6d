"""A GPU worker SIGKILLed (nothing of it runs: no shutdown, no finally) takes its vLLM
engine processes with it: an EngineCore left running, re-parented, would hold the
model's memory (on a GPU, its VRAM) and the restarted worker could not load.

Real processes: ``llm-batch worker gpu`` on the tiny model, and its own EngineCore
and Worker processes; only the worker's own pid is killed, not its process group.
The worker is started both ways a user starts it: the installed console script (the
README's and the Kubernetes manifests' way) and ``python -m llmbatch.cli.main``. A
spawned engine process re-imports the main module of the process that started it,
which differs between the two; the engine's processes must die with it either way.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.devstack.demo import wait_for_pollers
from tests.fixtures.worker_processes import (
    CONSOLE_SCRIPT,
    PYTHON_M,
    engine_tree,
    gpu_worker_process,
    stop_worker,
    until_group_gone,
)

pytestmark = pytest.mark.slow

# The engine's processes are gone this long after the worker's death at most: the
# kernel kills them at once, the resource tracker leaves when its pipe closes.
GONE_WITHIN_S = 30


@pytest.mark.parametrize("entry", [CONSOLE_SCRIPT, PYTHON_M], ids=["console-script", "python-m"])
async def test_a_sigkilled_gpu_worker_takes_its_engine_processes_with_it(
    stack: Settings, temporal_client: Client, model_name: str, tmp_path: Path, entry: Sequence[str]
) -> None:
    proc = gpu_worker_process(stack, model_name, tmp_path / "gpu-worker.log", entry=entry)
    try:
        await wait_for_pollers(
            temporal_client, [stack.gpu_task_queue(model_name)], procs=[proc], within_s=300
        )
        names = [p.name() for p in engine_tree(proc.pid)]
        assert any("EngineCore" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)  # the worker alone, as the OOM killer does
        killed = time.monotonic()
        proc.wait()
        assert await until_group_gone(proc, within_s=GONE_WITHIN_S) == []
        print(f"nothing of the worker left {time.monotonic() - killed:.1f} s after SIGKILL")
    finally:
        stop_worker(proc)  # its group: what outlived it too
