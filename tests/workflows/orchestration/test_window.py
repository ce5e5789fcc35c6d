"""The shard window: every shard once, at most max_concurrent_shards at a time, summed right."""

from __future__ import annotations

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import (
    FINALIZE_JOB,
    GENERATE,
    PLAN_JOB,
    PREPARE_SHARD,
    PROGRESS_QUERY,
    REPORT_DEAD_LETTERS,
    WRITE_SHARD,
)
from llmbatch.contract.states import JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import rows_of, tokens_for

SHARDS = 5
WINDOW = 2


@pytest.mark.parametrize(
    ("dead", "state"),
    [
        pytest.param({}, JobState.SUCCEEDED, id="succeeded"),
        pytest.param({1: 1, 3: 2}, JobState.COMPLETED_WITH_ERRORS, id="completed_with_errors"),
        pytest.param({s: rows_of(s) for s in range(SHARDS)}, JobState.FAILED, id="failed"),
    ],
)
async def test_window_runs_every_shard_once_and_sums_them(
    orchestration_client: Client, dead: dict[int, int], state: JobState
) -> None:
    """Five shards, window 2: each shard runs each step once, never more than two are
    in flight (held in prepare_shard while the window is full), the summary adds up every
    shard's succeeded, dead and tokens, and its state follows final_state."""
    async with orchestrate(orchestration_client, shards=SHARDS, dead=dead) as run:
        s = run.stand_ins
        for shard in range(SHARDS):
            s.close_gate(PREPARE_SHARD, shard)
        handle = await run.start_job(max_concurrent_shards=WINDOW)

        # The window fills and stays full: each finished shard lets exactly one in.
        await s.until_called(PREPARE_SHARD, 0)
        await s.until_called(PREPARE_SHARD, 1)
        progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
        assert progress.shards_running == [0, 1]
        assert progress.state == JobState.RUNNING
        for done, next_shard in [(1, 2), (0, 3), (3, 4)]:
            s.open_gate(PREPARE_SHARD, done)
            await s.until_called(PREPARE_SHARD, next_shard)
        for shard in (2, 4):
            s.open_gate(PREPARE_SHARD, shard)
        summary: JobSummary = await result_of(handle)

    succeeded = sum(rows_of(sh) - dead.get(sh, 0) for sh in range(SHARDS))
    assert s.max_in_flight == WINDOW
    # With no continue-as-new, every shard reported by its result: no signal either way.
    history = await run.client.get_workflow_handle(run.job_id).fetch_history()
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED not in {
        e.event_type for e in history.events
    }
    for shard in range(SHARDS):
        signalled = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        assert not await run.has_event(run.shard(shard).id, signalled), shard
        # Started knowing its first step (prepare_first): no patch marker either.
        marker = EventType.EVENT_TYPE_MARKER_RECORDED
        assert not await run.has_event(run.shard(shard).id, marker), shard
    assert [c.step for c in s.calls if c.shard is None] == [PLAN_JOB, FINALIZE_JOB]
    for shard in range(SHARDS):
        steps = [PREPARE_SHARD, GENERATE, WRITE_SHARD]
        if dead.get(shard):
            steps.append(REPORT_DEAD_LETTERS)
        assert s.steps_of(shard) == steps, shard
    assert summary.state == state
    assert (summary.shards_total, summary.shards_done, summary.shards_running) == (
        SHARDS,
        SHARDS,
        [],
    )
    assert summary.items_total == sum(rows_of(sh) for sh in range(SHARDS))
    assert (summary.items_succeeded, summary.items_dead) == (succeeded, sum(dead.values()))
    assert summary.tokens == tokens_for(succeeded)
    assert summary.failed_shards == []
    # What the job's workflow summed from the shards' reports, before finalize_job
    # (which recounts from the ledger) saw it.
    counted = s.called(FINALIZE_JOB)[0].detail
    assert isinstance(counted, JobSummary)
    assert (counted.items_succeeded, counted.items_dead, counted.tokens) == (
        succeeded,
        sum(dead.values()),
        tokens_for(succeeded),
    )
    assert counted.state == state
