"""ShardWorkflow: one shard's rows through fetch → render → generate → write."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from llmbatch.contract.dead_letters import FailShardInput
    from llmbatch.contract.messages import (
        FetchResult,
        RenderResult,
        ShardCounts,
        ShardInput,
        ShardSummary,
    )
    from llmbatch.contract.names import (
        FAIL_SHARD,
        FETCH_SHARD,
        GENERATE,
        RENDER_PROMPTS,
        REPORT_DEAD_LETTERS,
        SHARD_FINISHED_SIGNAL,
        SHARD_WORKFLOW,
        WRITE_SHARD,
    )

# A retried generate resumes from the ledger, so a short heartbeat timeout costs
# little and lets a dead GPU worker's shard move on within seconds.
GENERATE_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
CPU_STEP_TIMEOUT = timedelta(minutes=15)
# The CPU worker heartbeats every step in the background (workers/heartbeat.py), so a
# killed CPU worker's step is retried elsewhere after this, not after CPU_STEP_TIMEOUT.
CPU_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
GENERATE_TIMEOUT = timedelta(hours=12)
# Dead-lettering needs only Postgres: it retries until the ledger answers, so a
# shard's items are accounted for however long the database is away.
LEDGER_RETRY = RetryPolicy(maximum_interval=timedelta(seconds=30))


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
        summary = ShardSummary(shard=input.shard)
        try:
            summary = await self._run_steps(input, summary)
        except ActivityError as err:
            if isinstance(err.cause, CancelledError):
                raise
            summary = await self._fail(input, summary, err)
        if summary.dead or input.redrive:
            # A re-driven shard reports even with no dead item left: its report
            # replaces the one from before, which listed the items now done.
            await workflow.execute_activity(
                REPORT_DEAD_LETTERS,
                input,
                start_to_close_timeout=CPU_STEP_TIMEOUT,
                heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
                retry_policy=LEDGER_RETRY,
                summary=f"shard {input.shard}: report {summary.dead} dead items",
            )
        if input.parent_workflow_id is not None:
            await workflow.get_external_workflow_handle(input.parent_workflow_id).signal(
                SHARD_FINISHED_SIGNAL, summary
            )
        return summary

    async def _run_steps(self, input: ShardInput, summary: ShardSummary) -> ShardSummary:
        retry = _retry(input.spec.retry.max_activity_attempts)
        fetched: FetchResult = await workflow.execute_activity(
            FETCH_SHARD,
            input,
            result_type=FetchResult,
            start_to_close_timeout=CPU_STEP_TIMEOUT,
            heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
            retry_policy=retry,
            summary=f"shard {input.shard}: read rows",
        )
        summary.items = fetched.rows
        rendered: RenderResult = await workflow.execute_activity(
            RENDER_PROMPTS,
            input,
            result_type=RenderResult,
            start_to_close_timeout=CPU_STEP_TIMEOUT,
            heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
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
        return await self._write(input, retry)

    async def _write(self, input: ShardInput, retry: RetryPolicy) -> ShardSummary:
        summary: ShardSummary = await workflow.execute_activity(
            WRITE_SHARD,
            input,
            result_type=ShardSummary,
            start_to_close_timeout=CPU_STEP_TIMEOUT,
            heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
            retry_policy=retry,
            summary=f"shard {input.shard}: write output part",
        )
        return summary

    async def _fail(
        self, input: ShardInput, summary: ShardSummary, err: ActivityError
    ) -> ShardSummary:
        """The shard cannot finish: its unfinished items die with the reason, and the
        output part is still written (when storage allows) with what did succeed."""
        cause = err.cause or err
        # An ApplicationError's message may already start with its type's name.
        kind = cause.type if isinstance(cause, ApplicationError) and cause.type else None
        kind = kind or type(cause).__name__
        message = str(cause)
        reason = message if message.startswith(f"{kind}:") else f"{kind}: {message}"
        counts: ShardCounts = await workflow.execute_activity(
            FAIL_SHARD,
            FailShardInput(
                job_id=input.spec.job_id,
                model=input.spec.model,
                shard=input.shard,
                error_class="ShardFailed",
                message=f"shard {input.shard} failed in {err.activity_type}: {reason}",
            ),
            result_type=ShardCounts,
            start_to_close_timeout=CPU_STEP_TIMEOUT,
            heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
            retry_policy=LEDGER_RETRY,
            summary=f"shard {input.shard}: dead-letter unfinished items",
        )
        try:
            summary = await self._write(input, _retry(input.spec.retry.max_activity_attempts))
        except ActivityError as write_err:
            if isinstance(write_err.cause, CancelledError):
                raise
            summary.succeeded, summary.dead, summary.tokens = (
                counts.succeeded,
                counts.dead,
                counts.tokens,
            )
            summary.items = counts.succeeded + counts.dead
        summary.failed = reason
        return summary
