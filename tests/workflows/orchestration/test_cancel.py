"""Cancelling a job cancels its running shards; a shard outliving its job ends cleanly."""

from __future__ import annotations

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import CancelledError

from llmbatch.contract.messages import ShardSummary
from llmbatch.contract.names import (
    GENERATE,
    PREPARE_SHARD,
    RECORD_JOB_END,
    REPORT_BY_SIGNAL,
    WRITE_SHARD,
    shard_workflow_id,
)
from llmbatch.contract.states import JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import rows_of

SHARDS = 4
WINDOW = 3
HELD_AT_PREPARE = 0  # a CPU step, cancelled at once (TRY_CANCEL)
FINISHES_ANYWAY = 1  # its generate returns normally after the cancel reached it
CANCELLED_IN_GENERATE = 2  # its generate honours the cancel


async def test_cancelling_the_job_cancels_every_running_shard(
    orchestration_client: Client,
) -> None:
    """Three shards run (held in prepare_shard, in a generate that will ignore the cancel, in
    a generate that honours it) when the job is cancelled: the job and all three end
    CANCELED, none writes its output part (not even the one whose generate returned
    normally after the cancel), and the fourth shard never starts."""
    async with orchestrate(
        orchestration_client,
        shards=SHARDS,
        ignore_cancel=[(GENERATE, FINISHES_ANYWAY)],
    ) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, HELD_AT_PREPARE)
        s.close_gate(GENERATE, FINISHES_ANYWAY)
        s.close_gate(GENERATE, CANCELLED_IN_GENERATE)
        job = await run.start_job(max_concurrent_shards=WINDOW)
        await s.until_called(PREPARE_SHARD, HELD_AT_PREPARE)
        await s.until_called(GENERATE, FINISHES_ANYWAY)
        await s.until_called(GENERATE, CANCELLED_IN_GENERATE)

        await job.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await result_of(job)
        assert isinstance(ended.value.cause, CancelledError)
        for shard in (HELD_AT_PREPARE, FINISHES_ANYWAY, CANCELLED_IN_GENERATE):
            with pytest.raises(WorkflowFailureError) as shard_ended:
                await result_of(run.shard(shard))
            assert isinstance(shard_ended.value.cause, CancelledError), shard
            assert await run.status(shard_workflow_id(run.job_id, shard)) == (
                WorkflowExecutionStatus.CANCELED
            ), shard
        # The cancel reached both generates; one still returned a result.
        assert s.called(GENERATE, FINISHES_ANYWAY, event="cancel-ignored")
        assert s.called(GENERATE, CANCELLED_IN_GENERATE, event="cancelled")
        assert await run.has_event(
            shard_workflow_id(run.job_id, FINISHES_ANYWAY),
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        )
        assert await run.status(run.job_id) == WorkflowExecutionStatus.CANCELED
        assert not await run.exists(shard_workflow_id(run.job_id, 3))

    assert s.steps_of(HELD_AT_PREPARE) == [PREPARE_SHARD]
    for shard in (FINISHES_ANYWAY, CANCELLED_IN_GENERATE):
        assert s.steps_of(shard) == [PREPARE_SHARD, GENERATE], shard
    assert not s.called(WRITE_SHARD, FINISHES_ANYWAY)
    # The ledger's jobs row is told the job's end (it would say "running" for ever).
    assert [c.detail for c in s.called(RECORD_JOB_END)] == [JobState.CANCELLED]


async def test_shard_whose_job_is_gone_completes(orchestration_client: Client) -> None:
    """The job is terminated while its shard runs; the shard (abandoned, not
    cancelled), asked to report by signal (as a job about to continue as new asks),
    finishes its steps, fails to signal the closed job, and still ends COMPLETED with
    its summary, not FAILED."""
    async with orchestrate(orchestration_client, shards=1) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, 0)
        job = await run.start_job(max_concurrent_shards=1)
        await s.until_called(PREPARE_SHARD, 0)
        await job.terminate("the job is gone")
        assert await run.status(run.job_id) == WorkflowExecutionStatus.TERMINATED
        await run.shard(0).signal(REPORT_BY_SIGNAL, run.job_id)

        s.open_gate(PREPARE_SHARD, 0)
        summary: ShardSummary = await result_of(run.shard(0))
        workflow_id = shard_workflow_id(run.job_id, 0)
        assert await run.status(workflow_id) == WorkflowExecutionStatus.COMPLETED
        assert await run.has_event(
            workflow_id, EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED
        )

    assert s.steps_of(0) == [PREPARE_SHARD, GENERATE, WRITE_SHARD]
    assert (summary.shard, summary.succeeded, summary.dead) == (0, rows_of(0), 0)
