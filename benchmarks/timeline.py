"""A finished job's timeline from its Temporal histories: where the time of a job goes
that is not engine work.

From the job's and each shard's history: when the job started, when planning ended,
when each shard started and when each of its steps (activities) was scheduled, started
and completed, and when the job's workflow closed; and, given when the client started
and saw the end, those two. The engine's busy time is approximated by the union of the
``generate`` steps' runs (which also read, claim and record, so the idle time it shows
is a lower bound): the gaps in it are where the engine waited for us.

    from timeline import job_timeline
    print(await job_timeline(client, job_id, submitted=t0, seen_end=t1))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmbatch.contract.names import GENERATE, shard_workflow_id


@dataclass(frozen=True)
class Step:
    """One activity of a workflow: its name, and when it was scheduled, started and
    closed (wall clock, UTC)."""

    workflow: str
    name: str
    scheduled: datetime
    started: datetime | None
    closed: datetime | None


async def _history(client: Client, workflow_id: str) -> tuple[datetime, datetime, list[Step]]:
    """When the workflow started and closed, and its activities."""
    handle = client.get_workflow_handle(workflow_id)
    scheduled: dict[int, tuple[str, datetime]] = {}
    started: dict[int, datetime] = {}
    steps: list[Step] = []
    opened = closed = None
    async for event in handle.fetch_history_events():
        at = event.event_time.ToDatetime(tzinfo=UTC)
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            opened = opened or at
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = (attrs.activity_type.name, at)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[event.activity_task_started_event_attributes.scheduled_event_id] = at
        elif kind in (
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
        ):
            ended = (
                event.activity_task_completed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                else event.activity_task_failed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                else event.activity_task_timed_out_event_attributes
            )
            sid = ended.scheduled_event_id
            name, when = scheduled.pop(sid)
            steps.append(Step(workflow_id, name, when, started.get(sid), at))
        elif kind in (
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
        ):
            closed = at
    assert opened is not None and closed is not None, workflow_id
    return opened, closed, steps


def _busy(spans: list[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    """The union of ``spans``, in order."""
    merged: list[tuple[datetime, datetime]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


async def job_timeline(
    client: Client,
    job_id: str,
    *,
    shards: int,
    submitted: datetime | None = None,
    seen_end: datetime | None = None,
) -> str:
    """The job's timeline as lines of text, times in seconds from ``submitted`` (else
    from the job's start); datetimes are aware (UTC)."""
    job_open, job_close, job_steps = await _history(client, job_id)
    origin = submitted or job_open
    lines: list[str] = []

    def at(when: datetime | None) -> str:
        return "     -" if when is None else f"{(when - origin).total_seconds():6.2f}"

    if submitted is not None:
        lines.append(f"  {at(submitted)}  client starts the job")
    lines.append(f"  {at(job_open)}  job workflow started")
    for step in job_steps:
        lines.append(
            f"  {at(step.scheduled)}  job: {step.name} scheduled, started {at(step.started)}, "
            f"done {at(step.closed)}"
        )
    generate: list[tuple[datetime, datetime]] = []
    for shard in range(shards):
        wid = shard_workflow_id(job_id, shard)
        opened, closed, steps = await _history(client, wid)
        parts = [f"start {at(opened)}"]
        for step in steps:
            parts.append(f"{step.name} {at(step.started)}-{at(step.closed)}")
            if step.name == GENERATE and step.started and step.closed:
                generate.append((step.started, step.closed))
        parts.append(f"end {at(closed)}")
        lines.append(f"  shard {shard}: " + ", ".join(parts))
    busy = _busy(generate)
    if busy:
        first, last = busy[0][0], busy[-1][1]
        gaps = [(a[1], b[0]) for a, b in itertools.pairwise(busy) if b[0] > a[1]]
        idle = sum((b - a).total_seconds() for a, b in gaps)
        lines.append(
            f"  generate steps: first starts {at(first)}, last ends {at(last)}; "
            f"{len(gaps)} gaps between them, {idle:.2f} s in all"
            + "".join(f"; {at(a)}-{at(b)}" for a, b in gaps)
        )
    lines.append(f"  {at(job_close)}  job workflow closed")
    if seen_end is not None:
        lines.append(f"  {at(seen_end)}  client sees the end")
    if busy and submitted is not None and seen_end is not None:
        total = (seen_end - submitted).total_seconds()
        engine = sum((b - a).total_seconds() for a, b in busy)
        lines.append(
            f"  of {total:.2f} s: before the first generate {at(busy[0][0]).strip()} s, "
            f"generate steps {engine:.2f} s, after the last "
            f"{(seen_end - busy[-1][1]).total_seconds():.2f} s"
        )
    return "\n".join(lines)
