"""A GPU worker that is PID 1, as a container's main process is in Kubernetes, runs its
engine and stops cleanly on SIGTERM.

Its engine processes' parent is PID 1 while it lives: a process that took "my parent
is 1" for "my parent died" ended its own EngineCore at start. And PID 1 gets only the
signals it handles: the SIGTERM of a pod's stop must reach a handler.

Real processes: ``llm-batch worker gpu`` (the console script, and ``python -m``) as PID 1 of a PID
namespace of its own (``unshare``, as root), on the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from llmbatch.config import Settings
from llmbatch.devstack.demo import settings_env
from llmbatch.devstack.process import LoggedProcess
from tests.fixtures.worker_processes import (
    CONSOLE_SCRIPT,
    GPU_WORKER_KV_CACHE_BYTES,
    PYTHON_M,
    stop_worker,
    until_group_gone,
)

pytestmark = pytest.mark.slow

UNSHARE = shutil.which("unshare")


def _can_unshare() -> bool:
    if UNSHARE is None or os.geteuid() != 0:
        return False
    return subprocess.run([UNSHARE, "--pid", "--fork", "--mount-proc", "true"]).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare for a PID namespace")
@pytest.mark.parametrize("entry", [CONSOLE_SCRIPT, PYTHON_M], ids=["console-script", "python-m"])
async def test_a_gpu_worker_that_is_pid_1_runs_its_engine_and_stops_on_sigterm(
    stack: Settings, model_name: str, tmp_path: Path, entry: Sequence[str]
) -> None:
    assert UNSHARE is not None
    log = tmp_path / "gpu-worker.log"
    proc = LoggedProcess(
        [UNSHARE, "--pid", "--fork", "--mount-proc", *entry, "worker", "gpu",
         "--model", model_name, "--max-model-len", "512",
         "--kv-cache-memory-bytes", GPU_WORKER_KV_CACHE_BYTES],
        log=log,
        env={**os.environ, **settings_env(stack)},
        new_session=True,
    )  # fmt: skip
    try:
        for _ in range(3000):
            assert proc.poll() is None, proc.exit_message(30)
            if " polling " in log.read_text(errors="replace"):
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("the worker did not poll in 300 s")
        # unshare's child: the worker, PID 1 in its namespace.
        (worker,) = psutil.Process(proc.pid).children()
        os.kill(worker.pid, signal.SIGTERM)
        code = await asyncio.wait_for(asyncio.to_thread(proc.wait), 120)
        left = await until_group_gone(proc, within_s=10)
    finally:
        stop_worker(proc)
    assert code == 0, proc.exit_message(30)
    assert left == []
    said = log.read_text(errors="replace")
    assert "gpu worker draining" in said and "engine stopped in" in said
