"""ShardWorkflow: one shard's rows through prepare (read and render) → generate → write.

A shard with nothing left to generate after prepare is written by prepare itself."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    FailureError,
    TimeoutError,
    TimeoutType,
)

with workflow.unsafe.imports_passed_through():
    from llmbatch.contract.dead_letters import FailShardInput
    from llmbatch.contract.messages import (
        FetchResult,
        PrepareResult,
        RenderResult,
        ShardCounts,
        ShardInput,
        ShardSummary,
    )
    from llmbatch.contract.names import (
        FAIL_SHARD,
        FETCH_SHARD,
        GENERATE,
        PREPARE_SHARD,
        RENDER_PROMPTS,
        REPORT_BY_SIGNAL,
        REPORT_DEAD_LETTERS,
        SHARD_FINISHED_SIGNAL,
        SHARD_WORKFLOW,
        WRITE_SHARD,
    )
    from llmbatch.contract.priority import HIGHEST_PRIORITY, aged
    from llmbatch.contract.priority import describe as describe_priority
    from llmbatch.contract.progress import format_duration
    from llmbatch.contract.provider import PROVIDER_BATCH_WORKFLOW
    from llmbatch.contract.spec import EndpointVia
    from llmbatch.contract.states import ErrorClass, FailureType

from llmbatch.workflows import options


@workflow.defn(name=SHARD_WORKFLOW)
class ShardWorkflow:
    """Runs one shard and returns its summary, which is how the job workflow that
    started it learns it finished.

    The parent starts shards with ParentClosePolicy.ABANDON, so it can continue as
    new while shards run; a child's result would reach only the run that ends, so
    before it does it asks the shards still running to report by the
    ``shard_finished`` signal instead (``report_by_signal``), which goes to the job's
    newest run. Shards started by a job of an earlier release (``parent_workflow_id``
    set) always signal, as they did then.
    """

    def __init__(self) -> None:
        # The job workflow to signal when done, once it asks (report_by_signal).
        self._report_to: str | None = None

    @workflow.signal(name=REPORT_BY_SIGNAL)
    def report_by_signal(self, job_workflow_id: str) -> None:
        self._report_to = job_workflow_id

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
                **options.ledger_step(
                    summary=f"shard {input.shard}: report {summary.dead} dead", spec=input.spec
                ),
            )
        await _tell_parent(input.parent_workflow_id or self._report_to, input.shard, summary)
        return summary

    async def _run_steps(self, input: ShardInput, summary: ShardSummary) -> ShardSummary:
        spec, shard = input.spec, input.shard
        rendered: RenderResult
        # Set by starters that know prepare_shard: patched() would record a marker and
        # update a search attribute in every shard, two history events each.
        if input.prepare_first or workflow.patched(PREPARE_SHARD):
            prepared: PrepareResult = await workflow.execute_activity(
                PREPARE_SHARD,
                input,
                result_type=PrepareResult,
                **options.cpu_step(spec, summary=f"shard {shard}: read and render rows"),
            )
            summary.items, rendered = prepared.rows, prepared
            if prepared.summary is not None:
                # Answered whole, and written: prepare_shard did the write step's work.
                # Decided by the recorded result, so histories from before replay as
                # they ran (their results have no summary).
                _stop_if_cancelled()
                return prepared.summary
        else:
            # A shard started before prepare_shard existed: its two steps, as recorded.
            fetched: FetchResult = await workflow.execute_activity(
                FETCH_SHARD,
                input,
                result_type=FetchResult,
                **options.cpu_step(spec, summary=f"shard {shard}: read rows"),
            )
            summary.items = fetched.rows
            _stop_if_cancelled()
            rendered = await workflow.execute_activity(
                RENDER_PROMPTS,
                input,
                result_type=RenderResult,
                **options.cpu_step(spec, summary=f"shard {shard}: render prompts"),
            )
        if rendered.to_generate and spec.via is EndpointVia.BATCH:
            _stop_if_cancelled()
            # The endpoint's Batch API runs the shard; the child waits for it durably.
            try:
                await workflow.execute_child_workflow(
                    PROVIDER_BATCH_WORKFLOW,
                    input,
                    id=f"{workflow.info().workflow_id}/provider-batch",
                    priority=options.child_priority(spec),
                )
            except ChildWorkflowError as err:
                # A step of the child that failed for good fails the shard as a step
                # of its own would: its unfinished items die with the reason.
                if isinstance(err.cause, ActivityError):
                    raise err.cause from None
                raise
        elif rendered.to_generate:
            _stop_if_cancelled()
            # The shard page's details line: while this step waits, it is waiting for
            # a worker serving the model (the pending activity shows whether one took it).
            limit = input.generate_schedule_to_start
            place = describe_priority(spec)
            workflow.set_current_details(
                f"generate {rendered.to_generate} items: needs a worker serving {spec.model} "
                f"on task queue {input.gpu_task_queue}"
                + (f" (gives up after {format_duration(limit.total_seconds())})" if limit else "")
                + (f", waiting there at {place}" if place else "")
            )
            waiting = _GenerateWait(input)
            while True:
                try:
                    await workflow.execute_activity(
                        GENERATE,
                        input,
                        **options.generate_step(
                            spec,
                            task_queue=input.gpu_task_queue,
                            summary=f"shard {shard}: generate {rendered.to_generate} items"
                            + waiting.note(),
                            schedule_to_start=waiting.schedule_to_start(),
                            priority_key=waiting.priority_key,
                        ),
                    )
                    break
                except ActivityError as err:
                    # Stopped workers (spot notices, scale-downs) are no failure of the
                    # shard: when its last attempt was drained, the step starts afresh.
                    # A step that waited one aging interval is queued again a level
                    # higher, so no stream of urgent work starves it.
                    if not _drained(err) and not waiting.age(err):
                        raise
            workflow.set_current_details("")
        _stop_if_cancelled()
        return await self._write(input)

    async def _write(self, input: ShardInput) -> ShardSummary:
        summary: ShardSummary = await workflow.execute_activity(
            WRITE_SHARD,
            input,
            result_type=ShardSummary,
            **options.cpu_step(input.spec, summary=f"shard {input.shard}: write output part"),
        )
        return summary

    async def _fail(
        self, input: ShardInput, summary: ShardSummary, err: ActivityError
    ) -> ShardSummary:
        """The shard cannot finish: its unfinished items die with the reason, and the
        output part is still written (when storage allows) with what did succeed."""
        reason = _reason(input, err)
        counts: ShardCounts = await workflow.execute_activity(
            FAIL_SHARD,
            FailShardInput(
                job_id=input.spec.job_id,
                model=input.spec.model,
                shard=input.shard,
                error_class=_error_class(err),
                message=f"shard {input.shard} failed in {err.activity_type}: {reason}",
            ),
            result_type=ShardCounts,
            **options.ledger_step(
                summary=f"shard {input.shard}: dead-letter unfinished items", spec=input.spec
            ),
        )
        try:
            summary = await self._write(input)
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


class _GenerateWait:
    """How long the generate step may wait in the GPU queue, and at which priority.

    Temporal fixes an activity's priority when it is scheduled. To give waiting work
    a bounded wait, the step waits at most ``priority_aging`` (Temporal's
    schedule-to-start timeout, which it never retries); then it is scheduled again one
    level higher, until priority 1. The waits add up to the job's NoWorker limit
    (``generate_schedule_to_start``), which still ends a step no worker ever takes.
    """

    def __init__(self, input: ShardInput) -> None:
        self._aging = input.priority_aging
        self._left = input.generate_schedule_to_start
        self._start = input.spec.priority
        self.levels = 0

    @property
    def priority_key(self) -> int | None:
        # Unaged, the step keeps the job's own priority (unset stays unset).
        return self._start if self.levels == 0 else aged(self._start, levels=self.levels)

    def _can_age(self) -> bool:
        return self._aging is not None and aged(self._start, levels=self.levels) > (
            HIGHEST_PRIORITY
        )

    def schedule_to_start(self) -> timedelta | None:
        if not self._can_age():
            return self._left
        assert self._aging is not None
        return self._aging if self._left is None else min(self._aging, self._left)

    def note(self) -> str:
        return f" (aged to priority {self.priority_key})" if self.levels else ""

    def age(self, err: ActivityError) -> bool:
        """Whether ``err`` is an aging interval that ran out (the step is then queued
        again a level higher); False for the NoWorker limit or any other failure."""
        cause = err.cause
        if not (isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START):
            return False
        waited = self.schedule_to_start()
        if not self._can_age() or waited is None:
            return False
        if self._left is not None:
            if self._left <= waited:
                return False  # the NoWorker limit is spent
            self._left -= waited
        self.levels += 1
        workflow.logger.info(
            "shard waited %s for a worker: its generate step is queued again at priority %s",
            waited,
            self.priority_key,
        )
        return True


def _stop_if_cancelled() -> None:
    """End the shard as cancelled if its cancel has come.

    A step that finishes although the cancel was sent to it (the cancel reaches an
    activity with its next heartbeat, and a ``generate`` about to finish may finish
    first) returns normally, and the cancel is spent: without this check the
    shard would go on to its next step, and write and report as if nothing happened.
    """
    if workflow.cancellation_reason() is not None:
        raise asyncio.CancelledError()


async def _tell_parent(parent_id: str | None, shard: int, summary: ShardSummary) -> None:
    """Signal the summary to the job's workflow ``parent_id`` (None: the result says it
    all), if it still runs.

    A parent that was cancelled, terminated or timed out while this shard ran is
    closed: the signal fails, and there is nobody left to tell. The shard's work is
    in the ledger either way, so it ends cleanly rather than as a failed workflow.
    """
    if parent_id is None:
        return
    parent = workflow.get_external_workflow_handle(parent_id)
    try:
        await parent.signal(SHARD_FINISHED_SIGNAL, summary)
    except FailureError as err:
        workflow.logger.info(
            "shard %s: job %s has closed, its summary is not sent (%s)", shard, parent_id, err
        )


def _drained(err: ActivityError) -> bool:
    cause = err.cause
    return isinstance(cause, ApplicationError) and cause.type == FailureType.WORKER_DRAINED


def _error_class(err: ActivityError) -> ErrorClass:
    """Why the shard's unfinished items die: no worker for the model, a worker with
    another model, or (anything else) the shard failed."""
    cause = err.cause
    if isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START:
        return ErrorClass.NO_WORKER
    if isinstance(cause, ApplicationError) and cause.type == FailureType.WRONG_MODEL:
        return ErrorClass.WRONG_MODEL
    return ErrorClass.SHARD_FAILED


def _reason(input: ShardInput, err: ActivityError) -> str:
    """'<type>: <message>' of the step's failure, without doubling the type when an
    ApplicationError's message already starts with it."""
    cause = err.cause or err
    if isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START:
        # Temporal's own message ("activity ScheduleToStart timeout") does not say
        # what was missing; the user needs the model and how long it waited.
        limit = input.generate_schedule_to_start
        waited = f" within {format_duration(limit.total_seconds())}" if limit else ""
        return (
            f"{ErrorClass.NO_WORKER}: no worker served model {input.spec.model}{waited} "
            f"(task queue {input.gpu_task_queue})"
        )
    kind = cause.type if isinstance(cause, ApplicationError) and cause.type else None
    kind = kind or type(cause).__name__
    message = str(cause)
    return message if message.startswith(f"{kind}:") else f"{kind}: {message}"
