"""The CPU worker: workflows plus the activities that read, render and write."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from llmbatch import ledger, telemetry
from llmbatch.activities.api_batch import ApiBatchActivities
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.control import ControlActivities
from llmbatch.activities.dead_letters import DeadLetterActivities
from llmbatch.activities.legacy import LegacyActivities
from llmbatch.activities.planning import PlanningActivities
from llmbatch.activities.prepare import PrepareActivities
from llmbatch.activities.progress import ProgressActivities
from llmbatch.activities.provider_batch import ProviderBatchActivities
from llmbatch.activities.write import WriteActivities
from llmbatch.client.temporal import connect
from llmbatch.config import Settings
from llmbatch.stages.drain import Drain
from llmbatch.workers.heartbeat import HEARTBEAT_THROTTLE, BackgroundHeartbeatInterceptor
from llmbatch.workers.preflight import check_services
from llmbatch.workers.queues import export_gauges
from llmbatch.workers.shutdown import CONNECTION_ERRORS, connection_lost, serve
from llmbatch.workers.startup import tune_garbage_collector
from llmbatch.workflows.batch_job import BatchJobWorkflow
from llmbatch.workflows.dead_letter import DeadLetterWorkflow
from llmbatch.workflows.provider_batch import ProviderBatchWorkflow
from llmbatch.workflows.shard import ShardWorkflow


def build_cpu_worker(
    client: Client, ctx: ActivityContext, *, drain_timeout: timedelta = timedelta(0)
) -> Worker:
    """A worker on the CPU queue with every workflow and CPU activity registered.

    Stopped, it lets its reads, renders and writes run ``drain_timeout`` more before
    the SDK cancels them (0, in-process workers: at once).
    """
    planning, write = PlanningActivities(ctx), WriteActivities(ctx)
    prepare, legacy = PrepareActivities(ctx), LegacyActivities(ctx)
    control, progress = ControlActivities(ctx), ProgressActivities(ctx)
    dead_letters = DeadLetterActivities(ctx)
    api_batch = ApiBatchActivities(ctx)
    provider = ProviderBatchActivities(ctx)
    return Worker(
        client,
        task_queue=ctx.settings.cpu_task_queue,
        graceful_shutdown_timeout=drain_timeout,
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        workflows=[BatchJobWorkflow, ShardWorkflow, DeadLetterWorkflow, ProviderBatchWorkflow],
        # Tracing comes with a client from llmbatch.client.temporal.connect; added here otherwise.
        # Heartbeats: a killed worker's steps move on after their heartbeat timeout.
        interceptors=[*telemetry.worker_interceptors(client), BackgroundHeartbeatInterceptor()],
        activities=[
            planning.plan_job,
            planning.finalize_job,
            planning.record_job_end,
            prepare.prepare_shard,
            # Shards started before prepare_shard existed still run these two.
            legacy.fetch_shard,
            legacy.render_prompts,
            write.write_shard,
            dead_letters.fail_shard,
            dead_letters.report_dead_letters,
            dead_letters.requeue_dead_letters,
            control.set_job_paused,
            progress.count_running_items,
            api_batch.record_api_batch,
            api_batch.set_api_batch_status,
            api_batch.finish_api_batch,
            provider.submit,
            provider.check,
            provider.collect,
            provider.give_up,
            provider.cancel,
            provider.take_slot,
            provider.release_slot,
        ],
    )


@contextlib.asynccontextmanager
async def cpu_worker(settings: Settings, *, client: Client | None = None) -> AsyncIterator[Worker]:
    """Run a CPU worker for the duration of the block (used by the CLI and tests)."""
    client = client or await connect(settings)
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    ctx = ActivityContext(settings=settings, pool=pool)
    try:
        async with build_cpu_worker(client, ctx) as w:
            yield w
    finally:
        # Stopping the worker cancels its activities, and a cancelled render kills its
        # child at once, however long the template runs; idle render processes go here.
        ctx.close()
        await pool.close()


async def run_cpu_worker(settings: Settings) -> None:
    """Check the services, then run until SIGINT/SIGTERM.

    Raises StartupCheckFailed when a service is unreachable or misconfigured, and
    ConnectionLost when one goes away while the worker runs or stops: one line each.
    """
    telemetry.install(component="cpu-worker")
    client = await check_services(settings)
    name = "cpu worker"
    tune_garbage_collector()
    try:
        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
        # The engine queues' backlog as gauges, for dashboards and autoscalers.
        gauges = asyncio.create_task(export_gauges(client, pool, settings))
        try:
            await serve(
                build_cpu_worker(
                    client,
                    ActivityContext(settings=settings, pool=pool),
                    drain_timeout=settings.drain_timeout,
                ),
                drain=Drain(timeout=settings.drain_timeout),
                name=name,
                ready=f"{name} polling {settings.cpu_task_queue} on "
                f"{client.service_client.config.target_host}",
            )
        finally:
            gauges.cancel()
            await asyncio.gather(gauges, return_exceptions=True)
            await pool.close()
    except CONNECTION_ERRORS as exc:
        raise connection_lost(name, exc) from exc


def main(settings: Settings | None = None) -> None:
    asyncio.run(run_cpu_worker(settings or Settings()))
