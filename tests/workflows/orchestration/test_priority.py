"""A job's priority and tenant reach its shards, its re-drives and every activity,
also when the job's workflow itself was started without them (a bare client)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import Priority

from llmbatch.contract import search_attributes as sa
from llmbatch.contract.dead_letters import RedriveRequest, RedriveResult
from llmbatch.contract.messages import JobControlState, JobSummary
from llmbatch.contract.names import (
    FAIL_SHARD,
    FINALIZE_JOB,
    GENERATE,
    PAUSE_UPDATE,
    PLAN_JOB,
    PREPARE_SHARD,
    RECORD_JOB_END,
    REDRIVE_UPDATE,
    REPORT_DEAD_LETTERS,
    REQUEUE_DEAD_LETTERS,
    RESUME_UPDATE,
    SET_JOB_PAUSED,
    WRITE_SHARD,
    redrive_shard_workflow_id,
)
from llmbatch.contract.states import JobState
from tests.workflows.orchestration.harness import Run, orchestrate, result_of

SHARDS = 3
PLACED: dict[str, Any] = {"priority": 1, "tenant": "team-a", "tenant_weight": 2.0}
EXPECTED = Priority(priority_key=1, fairness_key="team-a", fairness_weight=2.0)


async def _priority_of(handle: WorkflowHandle[Any, Any]) -> Priority:
    """The priority Temporal holds for a workflow (what its tasks are queued with)."""
    described = await handle.describe()
    return Priority._from_proto(described.raw_description.workflow_execution_info.priority)


def _started(run: Run) -> list[tuple[str, int | None, int, Priority | None]]:
    return [
        (c.step, c.shard, c.redrive, c.priority) for c in run.stand_ins.calls if c.event == "start"
    ]


async def test_priority_and_tenant_reach_every_shard_and_activity(
    orchestration_client: Client,
) -> None:
    """A job started with no workflow priority but priority 1, tenant team-a (weight 2)
    in its spec: every activity task of the job, its shards (one with dead items, one
    failed), a pause and resume, and a re-drive of its dead items carries exactly that
    priority; so do its shard workflows, re-driven shards and dead-letter workflow.
    The job's search attributes, progress and summary name it."""
    async with orchestrate(
        orchestration_client, shards=SHARDS, dead={1: 1}, failures=[(PREPARE_SHARD, 2)]
    ) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, 0)
        job = await run.start_job(max_concurrent_shards=SHARDS, **PLACED)
        await s.until_called(PREPARE_SHARD, 0)
        await job.execute_update(PAUSE_UPDATE, result_type=JobControlState)
        await job.execute_update(RESUME_UPDATE, result_type=JobControlState)
        s.open_gate(PREPARE_SHARD, 0)
        summary: JobSummary = await result_of(job)
        assert summary.state == JobState.COMPLETED_WITH_ERRORS
        redriven = await run.dead_letters().execute_update(
            REDRIVE_UPDATE, RedriveRequest(), result_type=RedriveResult
        )
        assert redriven.shards == [1, 2]

        started = _started(run)
        steps = {step for step, *_ in started}
        assert steps == {
            PLAN_JOB,
            PREPARE_SHARD,
            GENERATE,
            WRITE_SHARD,
            FAIL_SHARD,
            REPORT_DEAD_LETTERS,
            SET_JOB_PAUSED,
            FINALIZE_JOB,
            REQUEUE_DEAD_LETTERS,
        }
        assert [c for c in started if c[3] != EXPECTED] == []
        # The GPU step of every shard run, the job's and the re-drive's.
        assert sorted(
            (shard, redrive) for step, shard, redrive, _ in started if step == GENERATE
        ) == [
            (0, 0),
            (1, 0),
            (1, 1),
            (2, 1),
        ]

        workflows = [
            *(run.shard(shard) for shard in range(SHARDS)),
            *(
                run.client.get_workflow_handle(redrive_shard_workflow_id(run.job_id, 1, shard))
                for shard in (1, 2)
            ),
            run.dead_letters(),
        ]
        for handle in workflows:
            assert await _priority_of(handle) == EXPECTED, handle.id
        # Started bare, the job's own workflow tasks run at the default priority...
        assert await _priority_of(job) == Priority.default
        # ...and it names its place for the Web UI itself.
        attributes = (await job.describe()).typed_search_attributes
        assert (attributes.get(sa.JOB_PRIORITY), attributes.get(sa.TENANT)) == ("1", "team-a")
        assert (summary.priority, summary.tenant) == (1, "team-a")


async def test_a_cancelled_job_records_its_end_at_its_priority(
    orchestration_client: Client,
) -> None:
    """Priority 5 alone: the cancel's bookkeeping (pause flag, end state) runs at
    priority 5 too, and no tenant is made up."""
    async with orchestrate(orchestration_client, shards=1) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, 0)
        job = await run.start_job(max_concurrent_shards=1, priority=5)
        await s.until_called(PREPARE_SHARD, 0)
        await job.cancel()
        await s.until_called(RECORD_JOB_END)

        started = _started(run)
        assert {step for step, *_ in started} >= {SET_JOB_PAUSED, RECORD_JOB_END}
        assert {c[3] for c in started} == {Priority(priority_key=5)}
        attributes = (await job.describe()).typed_search_attributes
        assert (attributes.get(sa.JOB_PRIORITY), attributes.get(sa.TENANT)) == ("5", None)


async def test_a_job_without_them_leaves_priority_to_temporal(
    orchestration_client: Client,
) -> None:
    """No priority, no tenant: every task is queued exactly as before these fields
    existed (nothing set, Temporal's defaults apply), and no search attribute says
    otherwise."""
    async with orchestrate(orchestration_client, shards=1) as run:
        job = await run.start_job(max_concurrent_shards=1)
        summary = await result_of(job)
        assert {c[3] for c in _started(run)} == {Priority.default}
        assert await _priority_of(run.shard(0)) == Priority.default
        attributes = (await job.describe()).typed_search_attributes
        assert (attributes.get(sa.JOB_PRIORITY), attributes.get(sa.TENANT)) == (None, None)
        assert (summary.priority, summary.tenant) == (None, None)
