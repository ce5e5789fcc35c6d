"""The remote worker: the ``generate`` activity loop on a remote endpoint.

``llm-batch worker remote --endpoint NAME`` serves, for each model the endpoint
serves (its ``GET /v1/models``, or the ``--model`` given), the task queue named for
the endpoint, task and model; each runs the same ``generate`` activity as a GPU
worker, driving a :class:`~llmbatch.remote.engine.RemoteEngine` instead of vLLM.
No model is loaded here: the process needs only the network and the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import Sequence

from temporalio.client import Client
from temporalio.worker import Worker

from llmbatch import ledger, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.generate import GenerateActivities
from llmbatch.config import Settings
from llmbatch.contract.spec import Task
from llmbatch.errors import LlmBatchError
from llmbatch.remote.endpoints import Endpoint, get_endpoint
from llmbatch.remote.engine import RemoteEngine
from llmbatch.remote.http import Transport, Verdict
from llmbatch.remote.pause import pause_workflow
from llmbatch.stages.drain import Drain
from llmbatch.workers.heartbeat import HEARTBEAT_THROTTLE
from llmbatch.workers.preflight import check_services
from llmbatch.workers.shutdown import CONNECTION_ERRORS, connection_lost, serve
from llmbatch.workers.startup import advertise

log = logging.getLogger(__name__)

DEFAULT_CONCURRENT_ACTIVITIES = 8


class RemoteWorkerError(LlmBatchError, RuntimeError):
    """The remote worker cannot start; one line."""


async def endpoint_models(endpoint: Endpoint) -> list[str]:
    """The models the endpoint serves (``GET /v1/models``)."""
    transport = Transport(
        endpoint.base_url,
        api_key=endpoint.api_key(),
        timeout_s=min(endpoint.timeout_s, 30.0),
        max_connections=1,
    )
    try:
        answer = await transport.get("/models")
    finally:
        await transport.close()
    if answer.verdict is not Verdict.OK or not isinstance(answer.body, dict):
        raise RemoteWorkerError(
            f"endpoint {endpoint.name}: cannot list its models ({answer.message}); "
            "name them with --model"
        )
    return [str(m["id"]) for m in answer.body.get("data") or [] if isinstance(m, dict)]


def build_remote_worker(
    client: Client,
    ctx: ActivityContext,
    engine: RemoteEngine,
    *,
    task: Task,
    max_concurrent_activities: int,
    max_in_flight: int | None,
    drain: Drain,
) -> Worker:
    """A worker on the endpoint's queue for ``engine``'s model; on a stop signal its
    activities drain as a GPU worker's do (requests in flight answered and recorded
    within ``drain``'s timeout, the rest given back)."""
    generate = GenerateActivities(
        ctx,
        engine,
        max_in_flight=max_in_flight or engine.default_max_in_flight,
        task=task,
        drain=drain,
    )
    return Worker(
        client,
        task_queue=ctx.settings.gpu_task_queue(engine.model, task, endpoint=engine.endpoint.name),
        activities=[generate.generate],
        max_concurrent_activities=max_concurrent_activities,
        graceful_shutdown_timeout=drain.timeout,
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        interceptors=telemetry.worker_interceptors(client),
    )


async def run_remote_worker(
    settings: Settings,
    *,
    endpoint_name: str,
    models: Sequence[str] = (),
    task: Task = Task.GENERATE,
    max_concurrent_activities: int = DEFAULT_CONCURRENT_ACTIVITIES,
    max_in_flight: int | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0)."""
    telemetry.install(component="remote-worker")
    client = await check_services(settings)
    name = f"remote worker ({endpoint_name})"
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    engines: list[RemoteEngine] = []
    try:
        endpoint = await get_endpoint(pool, endpoint_name)
        served = list(models) or await endpoint_models(endpoint)
        if not served:
            raise RemoteWorkerError(
                f"endpoint {endpoint_name} lists no model; name one with --model"
            )
        ctx = ActivityContext(settings=settings, pool=pool)
        # One drain for every model's worker: a stop signal starts it for all.
        drain = Drain(timeout=settings.drain_timeout)
        workers: list[Worker] = []
        for model in served:
            engine = await RemoteEngine.start(
                endpoint,
                model,
                pool=pool,
                on_capped=functools.partial(_pause_capped, client),
                policy=settings.remote_fault_policy,
            )
            engines.append(engine)
            workers.append(
                build_remote_worker(
                    client,
                    ctx,
                    engine,
                    task=task,
                    max_concurrent_activities=max_concurrent_activities,
                    max_in_flight=max_in_flight,
                    drain=drain,
                )
            )
        queues = [w.task_queue for w in workers]
        async with contextlib.AsyncExitStack() as stack:
            for worker, engine in zip(workers, engines, strict=True):
                if worker is not workers[0]:  # serve() runs the first
                    await stack.enter_async_context(worker)
                await stack.enter_async_context(
                    advertise(
                        pool,
                        worker,
                        model=engine.model,
                        task=task,
                        weights=engine.weights,
                        settings=settings,
                    )
                )
            await serve(
                workers[0],
                name=name,
                ready=f"{name} ({task}) for {', '.join(served)} at {endpoint.base_url} "
                f"polling {', '.join(queues)} on {client.service_client.config.target_host}",
                drain=drain,
            )
    except CONNECTION_ERRORS as exc:
        raise connection_lost(name, exc) from exc
    finally:
        for engine in engines:
            with contextlib.suppress(Exception):
                await engine.close()
        await pool.close()
    return 0


async def _pause_capped(client: Client, job_id: str) -> None:
    await pause_workflow(client, job_id=job_id)


def main(settings: Settings, **kwargs: object) -> None:
    code = asyncio.run(run_remote_worker(settings, **kwargs))  # type: ignore[arg-type]
    sys.exit(code)
