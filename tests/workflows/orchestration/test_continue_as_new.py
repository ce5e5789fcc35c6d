"""Continue-as-new with shards in flight: every shard is still counted exactly once."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus

from llmbatch.contract.messages import JobSummary
from llmbatch.contract.names import (
    FINALIZE_JOB,
    GENERATE,
    PREPARE_SHARD,
    WRITE_SHARD,
)
from llmbatch.contract.states import JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import rows_of, tokens_for

SHARDS = 12
WINDOW = 3


async def test_continue_as_new_with_shards_in_flight_counts_each_shard_once(
    short_history_client: Client,
) -> None:
    """On a server that suggests continue-as-new after 40 events, a job of 12 shards
    continues as new while shard 0 is held in prepare_shard (so every new run starts with
    shards still running, whose reports go to the newest run): the job completes
    with each shard run once and counted once, in a run other than the first. Shards
    running at a continue-as-new report by signal; the others by their result."""
    async with orchestrate(short_history_client, shards=SHARDS) as run:
        s = run.stand_ins
        s.close_gate(PREPARE_SHARD, 0)
        handle = await run.start_job(max_concurrent_shards=WINDOW)
        first_run = handle.first_execution_run_id
        assert first_run is not None
        # Every other shard passes through the two free places of the window, so
        # the history grows past the threshold while shard 0 is held: each
        # continue-as-new happens with shard 0 (at least) in flight.
        await s.until(lambda: all(s.called(WRITE_SHARD, sh) for sh in range(1, SHARDS)))
        s.open_gate(PREPARE_SHARD, 0)
        summary: JobSummary = await result_of(handle)

        assert await run.status(run.job_id, first_run) == WorkflowExecutionStatus.CONTINUED_AS_NEW
        latest = await run.client.get_workflow_handle(run.job_id).describe()
        assert latest.run_id != first_run
        assert latest.status == WorkflowExecutionStatus.COMPLETED
        # Shard 0 ran across each continue-as-new: asked to report by signal, it did;
        # shards that ended in the run that started them reported by their result.
        signalled = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        asked = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        assert await run.has_event(run.shard(0).id, asked)
        assert await run.has_event(run.shard(0).id, signalled)
        by_result = [sh for sh in range(SHARDS) if not await run.has_event(run.shard(sh).id, asked)]
        assert by_result
        for shard in by_result:
            assert not await run.has_event(run.shard(shard).id, signalled), shard

    for shard in range(SHARDS):
        assert s.steps_of(shard) == [PREPARE_SHARD, GENERATE, WRITE_SHARD], shard
    items = sum(rows_of(shard) for shard in range(SHARDS))
    assert summary.state == JobState.SUCCEEDED
    assert (summary.shards_done, summary.shards_running) == (SHARDS, [])
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (items, items, 0)
    assert summary.tokens == tokens_for(items)
    # The workflow's own sum of the shards' reports, before finalize_job recounted.
    counted = s.called(FINALIZE_JOB)[0].detail
    assert isinstance(counted, JobSummary)
    assert (counted.shards_done, counted.items_succeeded, counted.tokens) == (
        SHARDS,
        items,
        tokens_for(items),
    )
