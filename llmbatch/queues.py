"""The backlog of each engine task queue: what waits, who polls, what is unfinished.

Two views side by side, because neither alone tells an autoscaler the truth:
Temporal's task-queue stats (``DescribeTaskQueue`` with ``report_stats``) count the
activity tasks nobody has taken yet, but read 0 while a long ``generate`` runs and
reset when an idle queue partition unloads; the ledger counts every unfinished
item of every running job for the queue's model and task, whether queued or in a
worker's hands. ``llm-batch queues`` prints both; the CPU worker exports them as
OpenTelemetry gauges; KEDA scales on both (``deploy/k8s``).

An engine queue is known when a GPU worker served it once (``served_models``) or a
running job in the ledger names its model and task: a queue with zero workers is a
normal state, its jobs wait there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import metrics as otel_metrics
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from llmbatch.config import Settings, model_identity
from llmbatch.contract.spec import Task
from llmbatch.contract.states import JobState
from llmbatch.ledger import TERMINAL, Database
from llmbatch.telemetry import INSTRUMENTATION_NAME

log = logging.getLogger(__name__)

# How often the CPU worker refreshes the gauges (KEDA polls every 30 s by default).
EXPORT_EVERY_S = 30.0


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
    # Workers Temporal saw poll lately (it keeps a gone poller for a few minutes).
    pollers: int
    poller_identities: list[str]
    # Items of running jobs for this model and task that are not finished.
    unfinished_items: int
    running_jobs: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# One row per (model, task) of running jobs: the ledger's side of every queue (a job
# is listed from its plan on; its items from the moment their shard starts). The
# same count (for one model) is the query KEDA's postgresql trigger runs.
UNFINISHED_SQL = """
SELECT j.model, coalesce(j.spec->>'task', $3) AS task,
       count(i.item_id) FILTER (WHERE i.status <> ALL($2::text[])) AS unfinished,
       count(DISTINCT j.job_id) AS jobs
FROM jobs j LEFT JOIN items i ON i.job_id = j.job_id
WHERE j.status = $1
GROUP BY 1, 2
"""


def unfinished_items_query(model: str, task: Task) -> str:
    """The ledger's unfinished items of ``model`` and ``task`` as one SQL statement
    with its values inline, for KEDA's postgresql trigger (which binds no parameters):
    the manifests under deploy/k8s carry exactly this text (a test checks)."""

    def literal(value: str) -> str:
        return "'" + value.replace("'", "''") + "'"

    terminal = ", ".join(literal(s) for s in TERMINAL)
    return (
        "SELECT count(*) FROM items i JOIN jobs j ON j.job_id = i.job_id "
        f"WHERE j.status = {literal(JobState.RUNNING)} AND j.model = {literal(model)} "
        f"AND coalesce(j.spec->>'task', {literal(Task.GENERATE)}) = {literal(task)} "
        f"AND i.status NOT IN ({terminal})"
    )


async def unfinished_by_model(db: Database) -> dict[tuple[str, str], tuple[int, int]]:
    """(model, task) → (unfinished items, running jobs) of the ledger's running jobs."""
    rows = await db.fetch(UNFINISHED_SQL, JobState.RUNNING, TERMINAL, Task.GENERATE)
    return {(r["model"], r["task"]): (r["unfinished"], r["jobs"]) for r in rows}


async def engine_queues(client: Client, db: Database, settings: Settings) -> list[QueueBacklog]:
    """Every known engine queue with Temporal's stats and the ledger's unfinished items."""
    served = await db.fetch("SELECT task_queue, model, task FROM served_models")
    unfinished = await unfinished_by_model(db)
    # Keyed by queue: job specs and workers may spell one model differently.
    known: dict[str, tuple[str, str]] = {r["task_queue"]: (r["model"], r["task"]) for r in served}
    counts: dict[str, tuple[int, int]] = {}
    for (model, task), (items, jobs) in unfinished.items():
        queue = settings.gpu_task_queue(model, Task(task))
        known.setdefault(queue, (model, task))
        before = counts.get(queue, (0, 0))
        counts[queue] = (before[0] + items, before[1] + jobs)
    stats = await asyncio.gather(*(describe_queue(client, queue) for queue in known))
    result = [
        QueueBacklog(
            task_queue=queue,
            model=model,
            task=task,
            **stat,
            unfinished_items=counts.get(queue, (0, 0))[0],
            running_jobs=counts.get(queue, (0, 0))[1],
        )
        for (queue, (model, task)), stat in zip(known.items(), stats, strict=True)
    ]
    return sorted(result, key=lambda q: (model_identity(q.model), q.task))


async def describe_queue(client: Client, queue: str) -> dict[str, Any]:
    """Temporal's view of one activity task queue: backlog, its age, rates, pollers."""
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            report_stats=True,
        )
    )
    stats = response.stats
    return {
        "backlog": stats.approximate_backlog_count,
        "backlog_age_s": stats.approximate_backlog_age.ToTimedelta().total_seconds(),
        "add_rate": round(stats.tasks_add_rate, 3),
        "dispatch_rate": round(stats.tasks_dispatch_rate, 3),
        "pollers": len(response.pollers),
        "poller_identities": sorted(p.identity for p in response.pollers),
    }


class QueueGauges:
    """The backlog as OpenTelemetry gauges, one series per queue (attributes: queue,
    model, task)."""

    def __init__(self) -> None:
        meter = otel_metrics.get_meter(INSTRUMENTATION_NAME)
        self.backlog = meter.create_gauge(
            "llmbatch.queue.backlog",
            unit="{task}",
            description="Activity tasks waiting on an engine task queue (Temporal's count).",
        )
        self.backlog_age = meter.create_gauge(
            "llmbatch.queue.backlog_age",
            unit="s",
            description="Age of the oldest activity task waiting on an engine task queue.",
        )
        self.pollers = meter.create_gauge(
            "llmbatch.queue.pollers",
            unit="{worker}",
            description="Workers Temporal saw polling an engine task queue lately.",
        )
        self.unfinished = meter.create_gauge(
            "llmbatch.queue.unfinished_items",
            unit="{item}",
            description="Unfinished items of running jobs for an engine queue's model and task.",
        )

    def record(self, queues: list[QueueBacklog]) -> None:
        for q in queues:
            attrs = {
                "llmbatch.task_queue": q.task_queue,
                "llmbatch.model": q.model,
                "llmbatch.task": q.task,
            }
            self.backlog.set(q.backlog, attrs)
            self.backlog_age.set(q.backlog_age_s, attrs)
            self.pollers.set(q.pollers, attrs)
            self.unfinished.set(q.unfinished_items, attrs)


async def export_gauges(
    client: Client, db: Database, settings: Settings, *, every_s: float = EXPORT_EVERY_S
) -> None:
    """Refresh the gauges every ``every_s`` until cancelled (run by the CPU worker)."""
    gauges = QueueGauges()
    while True:
        started = time.monotonic()
        try:
            gauges.record(await engine_queues(client, db, settings))
        except Exception as exc:  # a metric gap, never a worker failure
            log.warning("queue gauges not refreshed: %s", exc)
        await asyncio.sleep(max(every_s - (time.monotonic() - started), 1.0))
