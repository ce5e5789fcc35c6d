"""Activity options of every workflow, declared once.

Each function returns a ``workflow.ActivityConfig`` for one kind of step, to be
spread into ``workflow.execute_activity(...)``. Timeouts are long enough for the
largest shard; heartbeat timeouts are short, so a dead worker's step moves to
another worker within seconds. The workers heartbeat at a fraction of the
heartbeat timeout the activity was started with (``activity.info()``), so the two
cannot drift apart (``activities/heartbeat.py``). Every step carries its job's
task-queue priority and tenant (``llmbatch.contract.priority``), given explicitly
rather than inherited, so they hold whoever started the workflow.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.common import Priority, RetryPolicy

with workflow.unsafe.imports_passed_through():
    from llmbatch.contract.priority import task_priority
    from llmbatch.contract.spec import JobSpec
    from llmbatch.contract.states import FailureType

# Every activity heartbeats (CPU steps in the background, generate with its
# progress), so a killed worker's step is retried after this, not after its timeout.
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
PLAN_TIMEOUT = timedelta(hours=1)
CPU_STEP_TIMEOUT = timedelta(minutes=15)
# A retried generate resumes from the ledger, so a long timeout costs nothing.
GENERATE_TIMEOUT = timedelta(hours=12)
# Pause and resume give up (and change nothing) if the ledger stays out of reach this long.
CONTROL_TIMEOUT = timedelta(minutes=2)

# Failures that no retry can mend.
NON_RETRYABLE = [FailureType.INVALID_JOB_SPEC, FailureType.SUPERSEDED, FailureType.WRONG_MODEL]


def step_retry(spec: JobSpec) -> RetryPolicy:
    """A step of the pipeline: transient failures retry with backoff, up to the
    job's attempt budget; then the shard (or job) is reported failed."""
    return RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=60),
        maximum_attempts=spec.retry.max_activity_attempts,
        non_retryable_error_types=[str(t) for t in NON_RETRYABLE],
    )


# Steps that need only Postgres (dead-lettering, re-drive bookkeeping) retry until
# the ledger answers, so a shard's items are accounted for however long it is away.
LEDGER_RETRY = RetryPolicy(maximum_interval=timedelta(seconds=30))


def plan_step(spec: JobSpec) -> workflow.ActivityConfig:
    return workflow.ActivityConfig(
        start_to_close_timeout=PLAN_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        retry_policy=step_retry(spec),
        summary="list inputs and plan shards",
        priority=task_priority(spec),
    )


def cpu_step(spec: JobSpec, *, summary: str) -> workflow.ActivityConfig:
    """fetch, render, write and finalize: seconds to minutes of I/O on a CPU worker."""
    return workflow.ActivityConfig(
        start_to_close_timeout=CPU_STEP_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        retry_policy=step_retry(spec),
        summary=summary,
        priority=task_priority(spec),
    )


def generate_step(
    spec: JobSpec,
    *,
    task_queue: str,
    summary: str,
    schedule_to_start: timedelta | None = None,
    priority_key: int | None = None,
) -> workflow.ActivityConfig:
    """The GPU step. ``schedule_to_start`` bounds the wait for a worker serving the
    model: Temporal does not retry that timeout, so the shard fails (NoWorker)
    instead of waiting for a worker that may never come. ``priority_key`` replaces the
    job's priority for a step that has been aged (workflows/shard.py)."""
    priority = task_priority(spec)
    if priority_key is not None:
        priority = dataclasses.replace(priority, priority_key=priority_key)
    return workflow.ActivityConfig(
        task_queue=task_queue,
        schedule_to_start_timeout=schedule_to_start,
        start_to_close_timeout=GENERATE_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        retry_policy=step_retry(spec),
        # Cancel must reach the engine and abort its requests before we go on.
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        summary=summary,
        # The GPU queue is where jobs compete: this is what puts a priority-1 job's
        # shard ahead of a backlog of priority-5 ones, and shares it between tenants.
        priority=priority,
    )


def ledger_step(*, summary: str, spec: JobSpec | None = None) -> workflow.ActivityConfig:
    """A Postgres-only step that must happen, however long the database is away.
    With ``spec``, it carries the job's priority (else it inherits its workflow's)."""
    return workflow.ActivityConfig(
        start_to_close_timeout=CPU_STEP_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        retry_policy=LEDGER_RETRY,
        summary=summary,
        priority=_priority_of(spec),
    )


def control_step(*, summary: str, spec: JobSpec | None = None) -> workflow.ActivityConfig:
    """Pause and resume: quick, and given up on if the ledger stays away. With
    ``spec``, it carries the job's priority (else it inherits its workflow's)."""
    return workflow.ActivityConfig(
        start_to_close_timeout=timedelta(seconds=30),
        schedule_to_close_timeout=CONTROL_TIMEOUT,
        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        summary=summary,
        priority=_priority_of(spec),
    )


def progress_step(spec: JobSpec) -> workflow.ActivityConfig:
    """A read of live progress: quick, tried twice, then skipped until the next one."""
    return workflow.ActivityConfig(
        start_to_close_timeout=timedelta(seconds=30),
        retry_policy=RetryPolicy(maximum_attempts=2),
        summary="read progress",
        priority=task_priority(spec),
    )


def child_priority(spec: JobSpec) -> Priority:
    """The priority a job's shard workflows (and re-driven shards) start with: the
    job's own, so their workflow tasks and their steps' defaults follow it."""
    return task_priority(spec)


def _priority_of(spec: JobSpec | None) -> Priority:
    return Priority.default if spec is None else task_priority(spec)
