"""A shard whose step fails for good: its items die as ShardFailed, the job goes on."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from llmbatch.contract.dead_letters import FailShardInput
from llmbatch.contract.messages import JobSummary, ShardSummary
from llmbatch.contract.names import (
    FAIL_SHARD,
    GENERATE,
    PREPARE_SHARD,
    REPORT_DEAD_LETTERS,
    WRITE_SHARD,
)
from llmbatch.contract.states import ErrorClass, JobState
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import FAILURE_MESSAGE, FAILURE_TYPE, rows_of

SHARDS = 3
FAILING = 1
PIPELINE = [PREPARE_SHARD, GENERATE, WRITE_SHARD]


@pytest.mark.parametrize("step", PIPELINE)
async def test_failed_step_fails_the_shard_not_the_job(
    orchestration_client: Client, step: str
) -> None:
    """A non-retryable failure in ``step`` of shard 1 makes the shard call fail_shard
    (ShardFailed, a message naming the step and the error), still write its part,
    report its dead items, and end COMPLETED with ``failed`` set; the job ends
    completed_with_errors with failed_shards == [1] and the other shards intact."""
    async with orchestrate(orchestration_client, shards=SHARDS, failures=[(step, FAILING)]) as run:
        handle = await run.start_job(max_concurrent_shards=SHARDS)
        summary: JobSummary = await result_of(handle)
        shard_summary: ShardSummary = await result_of(run.shard(FAILING))
    s = run.stand_ins

    reason = f"{FAILURE_TYPE}: {FAILURE_MESSAGE}"
    [fail] = s.called(FAIL_SHARD, FAILING)
    assert fail.detail == FailShardInput(
        job_id=run.job_id,
        model="stand-in-model",
        shard=FAILING,
        error_class=ErrorClass.SHARD_FAILED,
        message=f"shard {FAILING} failed in {step}: {reason}",
    )
    # Items that generate finished stay succeeded; the rest die with the shard.
    dead = 0 if step == WRITE_SHARD else rows_of(FAILING)
    ran = PIPELINE[: PIPELINE.index(step) + 1]
    after = [FAIL_SHARD, WRITE_SHARD] + ([REPORT_DEAD_LETTERS] if dead else [])
    assert s.steps_of(FAILING) == ran + after
    assert shard_summary.failed == reason
    assert (shard_summary.succeeded, shard_summary.dead) == (rows_of(FAILING) - dead, dead)
    for other in set(range(SHARDS)) - {FAILING}:
        assert s.steps_of(other) == PIPELINE, other

    assert summary.state == JobState.COMPLETED_WITH_ERRORS
    assert summary.failed_shards == [FAILING]
    assert summary.shards_done == SHARDS
    items = sum(rows_of(shard) for shard in range(SHARDS))
    assert (summary.items_succeeded, summary.items_dead) == (items - dead, dead)
