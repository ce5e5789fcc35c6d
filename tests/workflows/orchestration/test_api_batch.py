"""What BatchJobWorkflow decides for an OpenAI Batch API batch (``spec.api_batch``):
the batch's statuses and its end (files and final status) when it completes, fails
validation, expires at its completion window, or is cancelled. A plain job does none
of it."""

from __future__ import annotations

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError, CancelledError

from llmbatch.contract.names import (
    FINALIZE_JOB,
    FINISH_API_BATCH,
    GENERATE,
    PLAN_JOB,
    PREPARE_SHARD,
    RECORD_JOB_END,
    SET_API_BATCH_STATUS,
    shard_workflow_id,
)
from llmbatch.contract.states import BatchStatus, FailureType, JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import INVALID_BATCH_MESSAGE, Call, rows_of

DAY_S = 24 * 3600


def api_steps(calls: list[Call]) -> list[tuple[str, object]]:
    """The job-level steps that matter to a batch, in order, with their detail."""
    steps = (SET_API_BATCH_STATUS, FINALIZE_JOB, FINISH_API_BATCH, RECORD_JOB_END)
    return [(c.step, c.detail) for c in calls if c.step in steps and c.event == "start"]


async def test_a_batch_goes_finalizing_then_completed_with_its_files(
    orchestration_client: Client,
) -> None:
    async with orchestrate(orchestration_client, shards=2, dead={1: 1}) as run:
        job = await run.start_job(max_concurrent_shards=2, api_window_s=DAY_S)
        summary = await result_of(job)
    assert summary.state == JobState.COMPLETED_WITH_ERRORS
    steps = api_steps(run.stand_ins.calls)
    assert [s for s, _ in steps] == [SET_API_BATCH_STATUS, FINALIZE_JOB, FINISH_API_BATCH]
    assert steps[0][1] == BatchStatus.FINALIZING
    assert steps[2][1] == BatchStatus.COMPLETED


async def test_a_plain_job_touches_no_batch(orchestration_client: Client) -> None:
    async with orchestrate(orchestration_client, shards=1) as run:
        await result_of(await run.start_job(max_concurrent_shards=1))
    s = run.stand_ins
    assert not s.called(SET_API_BATCH_STATUS) and not s.called(FINISH_API_BATCH)


async def test_a_batch_that_fails_validation_runs_no_shard_and_ends_failed(
    orchestration_client: Client,
) -> None:
    async with orchestrate(orchestration_client, shards=2, invalid_batch=True) as run:
        job = await run.start_job(max_concurrent_shards=2, api_window_s=DAY_S)
        with pytest.raises(WorkflowFailureError) as ended:
            await result_of(job)
    cause = ended.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == FailureType.INVALID_JOB_SPEC
    assert cause.message == INVALID_BATCH_MESSAGE
    s = run.stand_ins
    assert s.called(PLAN_JOB) and not s.shards_at(PREPARE_SHARD)
    # plan_job wrote the errors; this (fenced) status only makes sure of the end.
    assert api_steps(s.calls) == [(SET_API_BATCH_STATUS, BatchStatus.FAILED)]


async def test_the_completion_window_stops_the_batch_and_ends_it_expired(
    orchestration_client: Client,
) -> None:
    """A one-second window, and shard 0's generate never finishes on its own: the
    window's timer ends the batch. Its running shard is cancelled, no other starts,
    and the batch ends ``expired`` (files made) as does the job, which completes."""
    async with orchestrate(orchestration_client, shards=3) as run:
        s = run.stand_ins
        s.close_gate(GENERATE, 0)
        job = await run.start_job(max_concurrent_shards=1, api_window_s=1)
        summary = await result_of(job)
        assert await run.status(run.job_id) == WorkflowExecutionStatus.COMPLETED
        description = await job.describe()
        assert (await description.memo()) == {"state": "expired"}
        if s.called(PREPARE_SHARD, 0):  # it started before the window closed: it was stopped
            with pytest.raises(WorkflowFailureError) as shard_ended:
                await result_of(run.shard(0))
            assert isinstance(shard_ended.value.cause, CancelledError)
            assert await run.status(shard_workflow_id(run.job_id, 0)) == (
                WorkflowExecutionStatus.CANCELED
            )
    assert summary.state == JobState.EXPIRED
    # Nothing succeeded: every request is in the error file.
    total = sum(rows_of(shard) for shard in range(3))
    assert (summary.items_succeeded, summary.items_dead) == (0, total)
    assert s.shards_at(PREPARE_SHARD) in ([], [0])
    assert api_steps(s.calls) == [
        (FINISH_API_BATCH, BatchStatus.EXPIRED),
        (RECORD_JOB_END, JobState.EXPIRED),
    ]


async def test_a_cancelled_batch_keeps_its_finished_results_and_ends_cancelled(
    orchestration_client: Client,
) -> None:
    """Shard 0 finishes, shard 1 is held in generate when the batch is cancelled: the
    shard is cancelled first, then the files are made (with shard 0's results) and
    the batch ends ``cancelled``, then the job's end is recorded."""
    async with orchestrate(orchestration_client, shards=3) as run:
        s = run.stand_ins
        s.close_gate(GENERATE, 1)
        job = await run.start_job(max_concurrent_shards=1, api_window_s=DAY_S)
        await s.until_called(GENERATE, 1)
        await job.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await result_of(job)
        assert isinstance(ended.value.cause, CancelledError)
        await s.until_called(GENERATE, 1, event="cancelled")
    assert api_steps(s.calls) == [
        (FINISH_API_BATCH, BatchStatus.CANCELLED),
        (RECORD_JOB_END, JobState.CANCELLED),
    ]
    assert s.shards_at(PREPARE_SHARD) == [0, 1]


async def test_a_batch_cancelled_while_it_validates_ends_cancelled_not_failed(
    orchestration_client: Client,
) -> None:
    """The cancel reaches the plan step in flight (the batch is validating): that
    step's cancellation is the batch's cancel, so it ends "cancelled" with no files
    and no shard run; it ended "failed" when the cancelled step was taken for a
    failure of the job."""
    async with orchestrate(orchestration_client, shards=2) as run:
        s = run.stand_ins
        s.close_gate(PLAN_JOB)
        job = await run.start_job(max_concurrent_shards=2, api_window_s=DAY_S)
        await s.until_called(PLAN_JOB)
        await job.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await result_of(job)
        assert isinstance(ended.value.cause, CancelledError)
        assert await run.status(run.job_id) == WorkflowExecutionStatus.CANCELED
        assert not await run.exists(shard_workflow_id(run.job_id, 0))
    assert [d for step, d in api_steps(s.calls) if step == SET_API_BATCH_STATUS][-1] == (
        BatchStatus.CANCELLED
    )
    assert not s.called(FINISH_API_BATCH)
