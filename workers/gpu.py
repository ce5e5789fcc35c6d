"""The GPU worker: one vLLM engine per process, serving ``generate`` for its model.

A worker serves one task: generate (vLLM's generate runner) or embed (its pooling
runner). Both run the same ``generate`` activity loop, on a queue named for the task.

The engine is built once at start (model load paid once) and shared by several
concurrent ``generate`` activities, each keeping many requests in flight, so
continuous batching always has work queued while other shards read or write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import psutil
from temporalio.client import Client
from temporalio.worker import Worker

from llmbatch import ledger, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.generate import GenerateActivities
from llmbatch.client.temporal import connect
from llmbatch.config import Settings
from llmbatch.contract.spec import Task
from llmbatch.engine.options import EngineOptions
from llmbatch.engine.vllm_engine import Engine
from llmbatch.stages.drain import Drain
from llmbatch.workers.heartbeat import HEARTBEAT_THROTTLE
from llmbatch.workers.preflight import check_services
from llmbatch.workers.shutdown import (
    CONNECTION_ERRORS,
    StoppableStart,
    connection_lost,
    serve,
)
from llmbatch.workers.startup import (
    ColdStart,
    advertise,
    clear_ready,
    mark_ready,
    tune_garbage_collector,
)

log = logging.getLogger(__name__)

DEFAULT_CONCURRENT_ACTIVITIES = 4


def build_gpu_worker(
    client: Client,
    ctx: ActivityContext,
    engine: Engine,
    *,
    model: str,
    max_concurrent_activities: int = DEFAULT_CONCURRENT_ACTIVITIES,
    max_in_flight: int | None = None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
    task: Task = Task.GENERATE,
    drain: Drain | None = None,
) -> Worker:
    """A worker on ``model``'s GPU queue for ``task`` running ``generate`` on ``engine``.

    ``drain`` is how its activities stop when it shuts down; its timeout is the
    worker's graceful shutdown timeout (none, in-process workers: abort at once).
    """
    drain = drain or Drain(timeout=timedelta(0))
    generate = GenerateActivities(
        ctx,
        engine,
        max_in_flight=max_in_flight or engine.default_max_in_flight,
        on_engine_dead=on_engine_dead,
        task=task,
        drain=drain,
    )
    return Worker(
        client,
        task_queue=ctx.settings.gpu_task_queue(model, task),
        activities=[generate.generate],
        max_concurrent_activities=max_concurrent_activities,
        graceful_shutdown_timeout=drain.timeout,
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        # Tracing comes with a client from llmbatch.client.temporal.connect; added here otherwise.
        interceptors=telemetry.worker_interceptors(client),
    )


@contextlib.asynccontextmanager
async def gpu_worker(
    settings: Settings,
    engine: Engine,
    *,
    model: str,
    client: Client | None = None,
    max_concurrent_activities: int = DEFAULT_CONCURRENT_ACTIVITIES,
    max_in_flight: int | None = None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
    task: Task = Task.GENERATE,
) -> AsyncIterator[Worker]:
    """Run a GPU worker on an already started engine for the duration of the block."""
    client = client or await connect(settings)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        worker = build_gpu_worker(
            client,
            ActivityContext(settings=settings, pool=pool),
            engine,
            model=model,
            max_concurrent_activities=max_concurrent_activities,
            max_in_flight=max_in_flight,
            on_engine_dead=on_engine_dead,
            task=task,
        )
        async with (
            worker,
            advertise(
                pool, worker, model=model, task=task, weights=engine.weights, settings=settings
            ),
        ):
            yield worker
    finally:
        await pool.close()


async def run_gpu_worker(
    settings: Settings,
    options: EngineOptions,
    *,
    max_concurrent_activities: int = DEFAULT_CONCURRENT_ACTIVITIES,
    max_in_flight: int | None = None,
    task: Task = Task.GENERATE,
) -> int:
    """Run until SIGINT/SIGTERM (exit code 0) or until the engine dies (exit code 1)."""
    name = "gpu worker"
    cold = ColdStart(name)
    telemetry.install(component="gpu-worker")
    # The cheap checks first: a bad DSN fails in a second, not after the model loads.
    client = await check_services(settings)
    cold.phase("imports and service checks")
    engine = await Engine.start(options.for_task(task))
    cold.phase("engine load (weights, compile, graph capture, KV cache)")
    tune_garbage_collector()
    dead = asyncio.Event()

    def engine_died(exc: BaseException) -> None:
        log.error("vLLM engine died (%s); stopping so a supervisor restarts this worker", exc)
        dead.set()

    drain = Drain(timeout=settings.drain_timeout)

    def polling() -> None:
        cold.phase("worker start")
        print(cold.report(), flush=True)
        mark_ready(settings.ready_file)

    try:
        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
        try:
            worker = build_gpu_worker(
                client,
                ActivityContext(settings=settings, pool=pool),
                engine,
                model=options.served_name,
                max_concurrent_activities=max_concurrent_activities,
                max_in_flight=max_in_flight,
                on_engine_dead=engine_died,
                task=task,
                drain=drain,
            )
            # Known by its served name (vLLM's --served-model-name), else as loaded.
            served = options.served_name
            async with advertise(
                pool, worker, model=served, task=task, weights=engine.weights, settings=settings
            ):
                await serve(
                    worker,
                    name=name,
                    ready=f"{name} ({task}) for {served} polling "
                    f"{settings.gpu_task_queue(served, task)} on "
                    f"{client.service_client.config.target_host}",
                    also=dead,
                    drain=drain,
                    started=polling,
                    stopping=lambda: clear_ready(settings.ready_file),
                )
        finally:
            await pool.close()
    except CONNECTION_ERRORS as exc:
        raise connection_lost(name, exc) from exc
    finally:
        stopping = time.monotonic()
        engine.shutdown()
        # After a drain: what a pod's grace period must leave for this, too.
        print(f"{name}: engine stopped in {time.monotonic() - stopping:.1f} s", flush=True)
    return 1 if dead.is_set() else 0


def main(settings: Settings, options: EngineOptions, **kwargs: Any) -> None:
    # A stop signal before the worker polls (a scale-down or a deploy during a model
    # load of minutes) ends the start: the engine's processes are killed mid-load.
    start = StoppableStart(end=functools.partial(_kill_engine_processes, wait=False))
    try:
        with start:
            code = asyncio.run(run_gpu_worker(settings, options, **kwargs))
    except BaseException:
        # Whatever the interrupted start raised in the end (StoppedWhileStarting, or
        # vLLM's own error for the engine killed under it), it was the stop.
        if start.signal is None:
            raise
        code = 0
    finally:
        _kill_engine_processes()
    if start.signal is not None:
        print(
            f"gpu worker stopped while starting ({start.signal.name}): the engine's "
            "processes were ended before it polled, so it held no work",
            flush=True,
        )
    sys.exit(code)


def _kill_engine_processes(*, wait: bool = True) -> None:
    """After an engine death its worker processes can outlive it, holding the memory
    the restarted worker needs; nothing of this process may survive it. Also how a
    stop signal ends a model load (see :class:`StoppableStart`), without ``wait``:
    vLLM, unwinding its start, reaps its own processes."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if wait:
        psutil.wait_procs(children, timeout=10)
