"""Re-drive arithmetic of DeadLetterWorkflow, and no re-drive before the job has ended."""

from __future__ import annotations

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from llmbatch.contract.dead_letters import DeadLetterView, RedriveRequest, RedriveResult
from llmbatch.contract.messages import JobSummary
from llmbatch.contract.names import (
    DEAD_LETTERS_QUERY,
    FINALIZE_JOB,
    GENERATE,
    PREPARE_SHARD,
    REDRIVE_UPDATE,
    REPORT_DEAD_LETTERS,
    REQUEUE_DEAD_LETTERS,
    WRITE_SHARD,
    redrive_shard_workflow_id,
)
from llmbatch.contract.states import FailureType, JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import DEAD_CLASS, rows_of, tokens_for

SHARDS = 4
DEAD = {1: 2, 3: 1}  # items dying in the job's own run
REDRIVE_DEAD = {3: 1}  # of those, dying again in the re-drive


async def test_redrive_reruns_requeued_shards_and_counts_from_the_ledger(
    orchestration_client: Client,
) -> None:
    """While the job runs, a re-drive is refused (JobStillRunning). Once it has ended
    with 3 dead items in shards 1 and 3, a re-drive requeues them, runs those two
    shards as children named by redrive_shard_workflow_id, and answers with the
    succeeded/dead numbers of finalize_job's recount: 2 saved, 1 dead again."""
    async with orchestrate(
        orchestration_client, shards=SHARDS, dead=DEAD, redrive_dead=REDRIVE_DEAD
    ) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, 0)
        job = await run.start_job(max_concurrent_shards=SHARDS)
        # Shards 1 and 3 have reported their dead items (the first report started
        # the dead-letter workflow); shard 0 holds the job open.
        await s.until_called(REPORT_DEAD_LETTERS, 1, event="done")
        await s.until_called(REPORT_DEAD_LETTERS, 3, event="done")
        dlq = run.dead_letters()
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await dlq.execute_update(REDRIVE_UPDATE, RedriveRequest(), result_type=RedriveResult)
        assert isinstance(refused.value.cause, ApplicationError)
        assert refused.value.cause.type == FailureType.JOB_STILL_RUNNING

        s.open_gate(PREPARE_SHARD, 0)
        summary: JobSummary = await result_of(job)
        items = sum(rows_of(shard) for shard in range(SHARDS))
        assert summary.state == JobState.COMPLETED_WITH_ERRORS
        assert (summary.items_succeeded, summary.items_dead) == (items - 3, 3)

        result = await dlq.execute_update(
            REDRIVE_UPDATE, RedriveRequest(), result_type=RedriveResult
        )
        assert result == RedriveResult(redrive=1, requeued=3, succeeded=2, dead=1, shards=[1, 3])
        for shard in (1, 3):
            assert s.steps_of(shard, redrive=1) == [
                PREPARE_SHARD,
                GENERATE,
                WRITE_SHARD,
                REPORT_DEAD_LETTERS,
            ]
            workflow_id = redrive_shard_workflow_id(run.job_id, 1, shard)
            assert await run.status(workflow_id) == WorkflowExecutionStatus.COMPLETED
        assert s.steps_of(0, redrive=1) == s.steps_of(2, redrive=1) == []
        assert len(s.called(REQUEUE_DEAD_LETTERS)) == 1
        assert len(s.called(FINALIZE_JOB)) == 2

        view = await dlq.query(DEAD_LETTERS_QUERY, result_type=DeadLetterView)
        assert (view.dead, view.by_class) == (1, {DEAD_CLASS: 1})
        assert view.redrives == [result]
        assert view.job is not None
        assert (view.job.items_succeeded, view.job.items_dead) == (items - 1, 1)
        assert view.job.tokens == tokens_for(items - 1)
        assert view.job.failed_shards == []
