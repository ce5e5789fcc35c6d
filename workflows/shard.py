"""ShardWorkflow: one shard's rows through fetch → render → generate → write."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from llmbatch.pipeline import (
        FETCH_SHARD,
        GENERATE,
        RENDER_PROMPTS,
        SHARD_FINISHED_SIGNAL,
        SHARD_WORKFLOW,
        WRITE_SHARD,
        FetchResult,
        RenderResult,
        ShardInput,
        ShardSummary,
    )

# A retried generate resumes from the ledger, so a short heartbeat timeout costs
# little and lets a dead GPU worker's shard move on within seconds.
GENERATE_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
CPU_STEP_TIMEOUT = timedelta(minutes=15)
GENERATE_TIMEOUT = timedelta(hours=12)


def _retry(spec_attempts: int) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=60),
        maximum_attempts=spec_attempts,
        non_retryable_error_types=["InvalidJobSpec", "Superseded"],
    )


@workflow.defn(name=SHARD_WORKFLOW)
class ShardWorkflow:
    """Runs one shard and reports its summary to the parent job by signal.

    The parent starts shards with ParentClosePolicy.ABANDON (so it can continue as
    new while shards run), which is why completion is a signal, not a child result.
    """

    @workflow.run
    async def run(self, input: ShardInput) -> ShardSummary:
        retry = _retry(input.spec.retry.max_activity_attempts)
        summary = ShardSummary(shard=input.shard)
        try:
            fetched: FetchResult = await workflow.execute_activity(
                FETCH_SHARD,
                input,
                result_type=FetchResult,
                start_to_close_timeout=CPU_STEP_TIMEOUT,
                retry_policy=retry,
                summary=f"shard {input.shard}: read rows",
            )
            summary.items = fetched.rows
            rendered: RenderResult = await workflow.execute_activity(
                RENDER_PROMPTS,
                input,
                result_type=RenderResult,
                start_to_close_timeout=CPU_STEP_TIMEOUT,
                retry_policy=retry,
                summary=f"shard {input.shard}: render prompts",
            )
            if rendered.to_generate:
                await workflow.execute_activity(
                    GENERATE,
                    input,
                    task_queue=input.gpu_task_queue,
                    start_to_close_timeout=GENERATE_TIMEOUT,
                    heartbeat_timeout=GENERATE_HEARTBEAT_TIMEOUT,
                    retry_policy=retry,
                    # Cancel must reach the engine and abort its requests before we go on.
                    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                    summary=f"shard {input.shard}: generate {rendered.to_generate} items",
                )
            summary = await workflow.execute_activity(
                WRITE_SHARD,
                input,
                result_type=ShardSummary,
                start_to_close_timeout=CPU_STEP_TIMEOUT,
                retry_policy=retry,
                summary=f"shard {input.shard}: write output part",
            )
        except ActivityError as err:
            if isinstance(err.cause, CancelledError):
                raise
            cause = err.cause or err
            summary.failed = f"{type(cause).__name__}: {cause}"
        await workflow.get_external_workflow_handle(input.parent_workflow_id).signal(
            SHARD_FINISHED_SIGNAL, summary
        )
        return summary
