"""The backlog of each engine task queue as Temporal sees it, beside the ledger's count.

Two views side by side, because neither alone tells an autoscaler the truth:
Temporal's task-queue stats (``DescribeTaskQueue`` with ``report_stats``) count the
activity tasks nobody has taken yet, but read 0 while a long ``generate`` runs and
reset when an idle queue partition unloads; the ledger
(:mod:`llmbatch.ledger.backlog`) counts every unfinished item of the queue's model
and task, queued or in a worker's hands. ``llm-batch queues`` prints both, the CPU
worker exports them as gauges (``llmbatch.workers.queues``), KEDA scales on both (deploy/k8s).

An engine queue is known when a GPU worker served it once (``served_models``) or a
running job names its model and task: a queue with zero workers is a normal state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import metrics as otel_metrics
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import Task
from llmbatch.telemetry import INSTRUMENTATION_NAME, MODEL, QUEUE_INSTRUMENTS, TASK, TASK_QUEUE


@dataclass(slots=True)
class QueueBacklog:
    """One engine task queue, as Temporal and the ledger see it now."""

    task_queue: str
    model: str
    task: str
    # Temporal's approximate count and age of activity tasks nobody has taken yet.
    backlog: int
    backlog_age_s: float
    add_rate: float
    dispatch_rate: float
    # Workers serving the queue now (:func:`live_workers`).
    pollers: int
    poller_identities: list[str]
    # Items of running jobs for this model and task that are not finished.
    unfinished_items: int
    running_jobs: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What the ledger says of the worker that last recorded itself on a queue: its
    identity (Temporal's), whether its row is fresh and not stopped, and when it
    stopped (epoch seconds; None: it has not)."""

    identity: str
    serving: bool
    stopped_at: float | None


async def engine_queues(
    client: Client,
    settings: Settings,
    *,
    served: Iterable[tuple[str, str, str]],
    unfinished: dict[tuple[str, str, str | None], tuple[int, int]],
    records: dict[str, WorkerRecord] | None = None,
) -> list[QueueBacklog]:
    """Every known engine queue with Temporal's stats: ``served`` is the ledger's
    (queue, model, task) of GPU workers, ``unfinished`` its (model, task, remote
    endpoint or None) → (unfinished items, running jobs), ``records`` queue → its
    :class:`WorkerRecord`."""
    # Keyed by queue: job specs and workers may spell one model differently.
    known: dict[str, tuple[str, str]] = {queue: (model, task) for queue, model, task in served}
    counts: dict[str, tuple[int, int]] = {}
    for (model, task, endpoint), (items, jobs) in unfinished.items():
        queue = settings.gpu_task_queue(model, Task(task), endpoint=endpoint)
        known.setdefault(queue, (model, task))
        before = counts.get(queue, (0, 0))
        counts[queue] = (before[0] + items, before[1] + jobs)
    stats = await asyncio.gather(*(describe_queue(client, queue) for queue in known))
    now = time.time()
    result = []
    for (queue, (model, task)), (stat, polled) in zip(known.items(), stats, strict=True):
        identities = live_workers(polled, (records or {}).get(queue), now=now)
        result.append(
            QueueBacklog(
                task_queue=queue,
                model=model,
                task=task,
                **stat,
                pollers=len(identities),
                poller_identities=identities,
                unfinished_items=counts.get(queue, (0, 0))[0],
                running_jobs=counts.get(queue, (0, 0))[1],
            )
        )
    return sorted(result, key=lambda q: (model_identity(q.model), q.task))


# A live worker polls again within about a minute (a long poll's length), unless every
# one of its activity slots is taken; Temporal goes on listing a worker that stopped for
# about five minutes after its last poll, which read as pollers with every worker gone.
POLLER_FRESH_S = 90.0


def live_workers(polled: dict[str, float], record: WorkerRecord | None, *, now: float) -> list[str]:
    """The identities serving a queue: those Temporal saw poll within
    :data:`POLLER_FRESH_S` (``polled``: identity → last poll, epoch seconds), less the
    ledger's stopped worker if it stopped after its last poll, plus the ledger's worker
    while its row says it serves (busy in every slot, it does not poll)."""
    live = {who for who, at in polled.items() if now - at <= POLLER_FRESH_S}
    if record is not None:
        last_poll = polled.get(record.identity)
        if record.stopped_at is not None and (last_poll is None or last_poll <= record.stopped_at):
            live.discard(record.identity)
        if record.serving:
            live.add(record.identity)
    return sorted(live)


async def describe_queue(client: Client, queue: str) -> tuple[dict[str, Any], dict[str, float]]:
    """Temporal's view of one activity task queue: backlog, its age and rates, and each
    poller's identity with its last poll (epoch seconds)."""
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            report_stats=True,
        )
    )
    stats = response.stats
    polled = {p.identity: float(p.last_access_time.ToSeconds()) for p in response.pollers}
    return {
        "backlog": stats.approximate_backlog_count,
        "backlog_age_s": stats.approximate_backlog_age.ToTimedelta().total_seconds(),
        "add_rate": round(stats.tasks_add_rate, 3),
        "dispatch_rate": round(stats.tasks_dispatch_rate, 3),
    }, polled


class QueueGauges:
    """The backlog as OpenTelemetry gauges (:data:`llmbatch.telemetry.QUEUE_INSTRUMENTS`),
    one series per queue."""

    def __init__(self) -> None:
        meter = otel_metrics.get_meter(INSTRUMENTATION_NAME)
        self._gauges = [
            meter.create_gauge(spec.name, unit=spec.unit, description=spec.description)
            for spec in QUEUE_INSTRUMENTS
        ]

    def record(self, queues: list[QueueBacklog]) -> None:
        for q in queues:
            attrs = {TASK_QUEUE: q.task_queue, MODEL: q.model, TASK: q.task}
            # In QUEUE_INSTRUMENTS' order.
            values = (q.backlog, q.backlog_age_s, q.pollers, q.unfinished_items)
            for gauge, value in zip(self._gauges, values, strict=True):
                gauge.set(value, attrs)
