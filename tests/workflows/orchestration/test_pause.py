"""Pause and resume: no new shard starts while paused; refused once the job has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from llmbatch.contract.messages import JobControlState, JobProgress, JobSummary
from llmbatch.contract.names import (
    FINALIZE_JOB,
    PAUSE_UPDATE,
    PREPARE_SHARD,
    PROGRESS_QUERY,
    RESUME_UPDATE,
    SET_JOB_PAUSED,
    WRITE_SHARD,
    shard_workflow_id,
)
from llmbatch.contract.states import FailureType, JobState
from tests.workflows.orchestration.harness import orchestrate, result_of

SHARDS = 4
WINDOW = 2


async def test_pause_holds_new_shards_and_resume_starts_them(
    orchestration_client: Client,
) -> None:
    """Paused while two shards run, the job lets them finish but starts no third;
    resume starts the rest; the ledger's flag is written True then False; while the
    job finalizes, pause and resume are refused with JobNotRunning."""
    async with orchestrate(orchestration_client, shards=SHARDS) as run:
        s = run.stand_ins
        for shard in (0, 1):
            s.close_gate(PREPARE_SHARD, shard)
        s.close_gate(FINALIZE_JOB)
        handle = await run.start_job(max_concurrent_shards=WINDOW)
        await s.until_called(PREPARE_SHARD, 0)
        await s.until_called(PREPARE_SHARD, 1)

        paused = await handle.execute_update(PAUSE_UPDATE, result_type=JobControlState)
        assert (paused.state, paused.paused) == (JobState.PAUSED, True)
        assert [c.detail for c in s.called(SET_JOB_PAUSED)] == [True]

        # The running shards finish and report (by their result, which reaches the
        # job's history a moment after the shard closes); the window has room, yet
        # nothing starts.
        for shard in (0, 1):
            s.open_gate(PREPARE_SHARD, shard)
            await result_of(run.shard(shard))
        progress = await _progress_once(handle, lambda p: p.shards_done == 2)
        assert (progress.state, progress.paused) == (JobState.PAUSED, True)
        assert (progress.shards_done, progress.shards_running) == (2, [])
        assert sorted(s.shards_at(PREPARE_SHARD)) == [0, 1]
        assert not await run.exists(shard_workflow_id(run.job_id, 2))

        resumed = await handle.execute_update(RESUME_UPDATE, result_type=JobControlState)
        assert (resumed.state, resumed.paused) == (JobState.RUNNING, False)
        assert [c.detail for c in s.called(SET_JOB_PAUSED)] == [True, False]

        # Held in finalize_job: the job has ended its shards and refuses control.
        await s.until_called(FINALIZE_JOB)
        assert sorted(s.shards_at(WRITE_SHARD)) == [0, 1, 2, 3]
        for update in (PAUSE_UPDATE, RESUME_UPDATE):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update(update, result_type=JobControlState)
            cause = refused.value.cause
            assert isinstance(cause, ApplicationError)
            assert cause.type == FailureType.JOB_NOT_RUNNING
            assert f"cannot {update} job {run.job_id}" in cause.message
        s.open_gate(FINALIZE_JOB)
        summary: JobSummary = await result_of(handle)

        # Closed: the server itself refuses (the CLI checks the status before asking).
        with pytest.raises(RPCError):
            await handle.execute_update(PAUSE_UPDATE, result_type=JobControlState)

    assert (summary.state, summary.paused, summary.shards_done) == (JobState.SUCCEEDED, False, 4)
    assert [c.detail for c in s.called(SET_JOB_PAUSED)] == [True, False]


async def _progress_once(
    handle: WorkflowHandle[Any, Any], done: Callable[[JobProgress], bool]
) -> JobProgress:
    """The job's progress once ``done`` holds for it (or after a few seconds)."""
    for _ in range(100):
        progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
        if done(progress):
            break
        await asyncio.sleep(0.05)
    return progress
