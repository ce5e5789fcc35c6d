"""Recurring jobs on Temporal Schedules: create, list, trigger, delete.

A schedule starts ``BatchJobWorkflow`` with a JobSpec that leaves ``job_id`` out.
Temporal names each run's workflow ``<schedule name>-<scheduled UTC time, RFC 3339>``
(e.g. ``nightly-2025-06-01T02:00:00Z``) and the workflow takes that id as its job id,
so every run is a job of its own: its own ledger rows, its own output folder
(``<output_uri>/<job id>/``), its own page in the Web UI. A shared job id would make
the second run find every item already done.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleDescription,
    ScheduleHandle,
    ScheduleListActionStartWorkflow,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
)
from temporalio.service import RPCError, RPCStatusCode

from llmbatch.client.temporal import job_search_attributes
from llmbatch.config import Settings
from llmbatch.contract.messages import BatchJobInput
from llmbatch.contract.names import BATCH_JOB_WORKFLOW
from llmbatch.contract.priority import task_priority
from llmbatch.contract.spec import JobSpec
from llmbatch.errors import LlmBatchError

# A run's job id is "<name>-<20-character time>" and must fit the 128 characters
# of a job id; no ":" in names, so the time is the only part that has one.
SCHEDULE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
# The schedule memo keeps what the server does not give back as it was written: it
# turns cron expressions into calendar specs.
MEMO_KEY = "llm_batch"
# A run missed by more than this (Temporal down at the time) is skipped, not run late.
CATCHUP_WINDOW = timedelta(hours=1)


class ScheduleError(LlmBatchError):
    """A schedule operation that cannot be done; the message is one line for a person."""


class ScheduleExists(ScheduleError):
    pass


class ScheduleNotFound(ScheduleError):
    pass


class InvalidSchedule(ScheduleError):
    pass


class ScheduledRun(BaseModel):
    """One run a schedule started: a job whose id is its workflow id."""

    job_id: str
    scheduled_at: str
    started_at: str


class ScheduleSummary(BaseModel):
    """What ``llm-batch schedule list`` shows for one schedule."""

    name: str
    cron: list[str] = Field(default_factory=list)
    timezone: str | None = None
    model: str = ""
    # The remote endpoint its runs call (named, or the model's route when created).
    endpoint: str | None = None
    inputs: list[str] = Field(default_factory=list)
    output_uri: str = ""
    paused: bool = False
    note: str = ""
    next_runs: list[str] = Field(default_factory=list)
    recent_runs: list[ScheduledRun] = Field(default_factory=list)
    running_jobs: list[str] = Field(default_factory=list)


def check_name(name: str) -> None:
    if not re.fullmatch(SCHEDULE_NAME_PATTERN, name):
        raise InvalidSchedule(
            f"bad schedule name {name!r}: letters, digits, '.', '_' or '-', at most 100, "
            "starting with a letter or digit"
        )


async def create_schedule(
    client: Client,
    name: str,
    spec: JobSpec,
    *,
    cron: Sequence[str],
    settings: Settings,
    timezone: str | None = None,
    overlap: ScheduleOverlapPolicy = ScheduleOverlapPolicy.SKIP,
    paused: bool = False,
    note: str = "",
) -> ScheduleHandle:
    """Create schedule ``name`` that starts ``spec`` as a new job at every ``cron`` time.

    ``spec`` must leave ``job_id`` out: each run takes its workflow id as job id. With
    the default overlap policy a run that comes while the previous one still works is
    skipped.
    """
    check_name(name)
    if spec.job_id:
        raise InvalidSchedule(
            "a schedule's runs take their job ids from Temporal "
            f"('{name}-<scheduled UTC time>'): leave job_id out"
        )
    crons = [c.strip() for c in cron if c.strip()]
    if not crons:
        raise InvalidSchedule("give at least one --cron expression")
    if timezone is not None:
        try:
            zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise InvalidSchedule(f"unknown time zone {timezone!r}") from None
    action = ScheduleActionStartWorkflow(
        BATCH_JOB_WORKFLOW,
        BatchJobInput(spec=spec),
        # Temporal appends "-<scheduled time>" to this for each run.
        id=name,
        task_queue=settings.cpu_task_queue,
        typed_search_attributes=job_search_attributes(spec),
        static_summary=f"schedule {name}: {spec.model} over {', '.join(spec.inputs)[:200]}",
        priority=task_priority(spec),
    )
    schedule = Schedule(
        action=action,
        spec=ScheduleSpec(cron_expressions=crons, time_zone_name=timezone),
        policy=SchedulePolicy(overlap=overlap, catchup_window=CATCHUP_WINDOW),
        state=ScheduleState(paused=paused, note=note),
    )
    try:
        return await client.create_schedule(
            name, schedule, memo={MEMO_KEY: {"cron": crons, "timezone": timezone}}
        )
    except ScheduleAlreadyRunningError:
        raise ScheduleExists(
            f"schedule {name!r} exists already (llm-batch schedule delete {name} first)"
        ) from None
    except RPCError as exc:
        if exc.status == RPCStatusCode.INVALID_ARGUMENT:
            raise InvalidSchedule(
                f"schedule refused: {_one_line(exc.message)} (cron {', '.join(crons)!r})"
            ) from None
        raise


async def list_schedules(client: Client) -> list[ScheduleSummary]:
    """Every schedule in the namespace that starts llm-batch jobs, by name."""
    names = []
    async for entry in await client.list_schedules():
        action = entry.schedule.action if entry.schedule else None
        if isinstance(action, ScheduleListActionStartWorkflow) and (
            action.workflow == BATCH_JOB_WORKFLOW
        ):
            names.append(entry.id)
    summaries = []
    for name in sorted(names):
        try:
            summaries.append(await describe_schedule(client, name))
        except ScheduleNotFound:
            continue  # deleted since it was listed
    return summaries


async def describe_schedule(client: Client, name: str) -> ScheduleSummary:
    try:
        description = await client.get_schedule_handle(name).describe()
    except RPCError as exc:
        raise _not_found(exc, name) from None
    return await _summary(client, description)


async def trigger_schedule(client: Client, name: str) -> None:
    """Start a run now (it is a new job like any scheduled run)."""
    try:
        await client.get_schedule_handle(name).trigger()
    except RPCError as exc:
        raise _not_found(exc, name) from None


async def delete_schedule(client: Client, name: str) -> None:
    """Delete the schedule; runs it started go on."""
    try:
        await client.get_schedule_handle(name).delete()
    except RPCError as exc:
        raise _not_found(exc, name) from None


async def _summary(client: Client, description: ScheduleDescription) -> ScheduleSummary:
    schedule, info = description.schedule, description.info
    memo: dict[str, Any] = dict((await description.memo()).get(MEMO_KEY) or {})
    summary = ScheduleSummary(
        name=description.id,
        cron=memo.get("cron") or list(schedule.spec.cron_expressions),
        timezone=memo.get("timezone") or schedule.spec.time_zone_name,
        paused=schedule.state.paused,
        note=schedule.state.note or "",
        next_runs=[t.isoformat() for t in info.next_action_times],
        running_jobs=[
            r.workflow_id
            for r in info.running_actions
            if isinstance(r, ScheduleActionExecutionStartWorkflow)
        ],
    )
    for result in info.recent_actions:
        if isinstance(result.action, ScheduleActionExecutionStartWorkflow):
            summary.recent_runs.append(
                ScheduledRun(
                    job_id=result.action.workflow_id,
                    scheduled_at=result.scheduled_at.isoformat(),
                    started_at=result.started_at.isoformat(),
                )
            )
    action = schedule.action
    if isinstance(action, ScheduleActionStartWorkflow) and action.args:
        # Described actions hold their arguments as raw payloads.
        decoded = await client.data_converter.decode(list(action.args), [BatchJobInput])
        spec: JobSpec = decoded[0].spec
        summary.model, summary.endpoint, summary.inputs, summary.output_uri = (
            spec.model,
            spec.remote_endpoint,
            list(spec.inputs),
            spec.output_uri,
        )
    return summary


def _not_found(exc: RPCError, name: str) -> Exception:
    if exc.status == RPCStatusCode.NOT_FOUND:
        return ScheduleNotFound(f"no schedule {name!r}")
    return exc


def _one_line(message: str) -> str:
    return " ".join(message.split())
