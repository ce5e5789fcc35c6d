"""DeadLetterWorkflow: a job's dead items, queryable and re-drivable ("<job>/dlq")."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from llmbatch.contract.dead_letters import (
        DeadLetterEntry,
        DeadLetterInput,
        DeadLetterView,
        RedriveRequest,
        RedriveResult,
        RequeueInput,
        RequeueResult,
        ShardDeadLetters,
    )
    from llmbatch.contract.messages import FinalizeInput, JobSummary, ShardInput, ShardSummary
    from llmbatch.contract.names import (
        DEAD_LETTER_WORKFLOW,
        DEAD_LETTERS_QUERY,
        DEAD_LETTERS_SIGNAL,
        FINALIZE_JOB,
        JOB_FINISHED_SIGNAL,
        REDRIVE_UPDATE,
        REQUEUE_DEAD_LETTERS,
        SHARD_WORKFLOW,
        redrive_shard_workflow_id,
    )
    from llmbatch.contract.states import ErrorClass, FailureType

from llmbatch.workflows import options

# The list a query answers stays below this many entries (every item is counted, and
# the error files next to the output hold them all): the workflow's state must fit in
# one continue-as-new payload whatever the number of dead items.
MAX_LISTED = 2000
# Once the job has ended and nothing has happened for this long, the list closes; the
# ledger and the error files keep the dead items.
IDLE_RETENTION = timedelta(days=7)


@workflow.defn(name=DEAD_LETTER_WORKFLOW)
class DeadLetterWorkflow:
    """Holds a job's dead items, as its shards report them, and re-drives them.

    Shards report by signal-with-start (the first report starts this workflow), and
    a report replaces what the shard reported before, so a re-driven shard's report
    removes the items that now succeeded. The job's workflow signals its final
    summary; re-drives are accepted only after that.
    """

    @workflow.init
    def __init__(self, input: DeadLetterInput) -> None:
        self._input = input
        self._state = input.state
        self._redriving = False
        self._touched = False

    @workflow.signal(name=DEAD_LETTERS_SIGNAL)
    def dead_letters(self, report: ShardDeadLetters) -> None:
        shards = self._state.shards
        if report.count == 0:
            shards.pop(report.shard, None)
        else:
            shards[report.shard] = report
        self._touched = True

    @workflow.signal(name=JOB_FINISHED_SIGNAL)
    def job_finished(self, summary: JobSummary) -> None:
        if self._state.job is None:
            self._state.job = summary
        self._touched = True

    @workflow.query(name=DEAD_LETTERS_QUERY)
    def view(self) -> DeadLetterView:
        by_class: dict[ErrorClass, int] = {}
        entries: list[DeadLetterEntry] = []
        listed_all = True
        for shard in sorted(self._state.shards):
            report = self._state.shards[shard]
            for error_class, n in report.by_class.items():
                by_class[error_class] = by_class.get(error_class, 0) + n
            room = MAX_LISTED - len(entries)
            entries.extend(report.entries[:room])
            listed_all = listed_all and len(report.entries) == report.count <= room
        return DeadLetterView(
            job_id=self._input.job_id,
            dead=sum(by_class.values()),
            by_class=by_class,
            entries=entries,
            listed_all=listed_all,
            job=self._state.job,
            redrives=self._state.redrives,
            redriving=self._redriving,
        )

    @workflow.update(name=REDRIVE_UPDATE)
    async def redrive(self, request: RedriveRequest) -> RedriveResult:
        """Run the selected dead items again; those that succeed join the output."""
        self._redriving = True
        try:
            return await self._redrive(request)
        finally:
            self._redriving = False
            self._touched = True

    @redrive.validator
    def _validate_redrive(self, request: RedriveRequest) -> None:
        job_id = self._input.job_id
        if self._state.job is None:
            raise ApplicationError(
                f"job {job_id} is still running; re-drive its dead items once it has ended",
                type=FailureType.JOB_STILL_RUNNING,
            )
        if self._redriving:
            raise ApplicationError(
                f"a re-drive of job {job_id} is already running",
                type=FailureType.REDRIVE_RUNNING,
            )
        if request.sampling:
            try:
                self._input.spec.options_with(request.sampling)
            except ValidationError as exc:
                raise ApplicationError(
                    f"invalid options for the re-drive: {_first_error(exc)}",
                    type=FailureType.INVALID_REDRIVE,
                ) from None

    @workflow.run
    async def run(self, input: DeadLetterInput) -> DeadLetterView:
        while True:
            self._touched = False
            try:
                await workflow.wait_condition(
                    lambda: self._touched or workflow.info().is_continue_as_new_suggested(),
                    timeout=IDLE_RETENTION if self._state.job is not None else None,
                )
            except TimeoutError:
                if not self._redriving:
                    break
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(input.model_copy(update={"state": self._state}))
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.view()

    async def _redrive(self, request: RedriveRequest) -> RedriveResult:
        input, state = self._input, self._state
        job = state.job
        assert job is not None  # the validator refuses a re-drive before the job ends
        number = len(state.redrives) + 1
        requeued: RequeueResult = await workflow.execute_activity(
            REQUEUE_DEAD_LETTERS,
            RequeueInput(
                job_id=input.job_id,
                item_ids=request.item_ids,
                error_classes=request.error_classes,
            ),
            result_type=RequeueResult,
            **options.ledger_step(
                summary=f"re-drive {number}: requeue dead items", spec=input.spec
            ),
        )
        summaries: list[ShardSummary] = []
        window = input.spec.max_concurrent_shards
        for start in range(0, len(requeued.shards), window):
            batch = requeued.shards[start : start + window]
            summaries += await asyncio.gather(
                *(self._run_shard(shard, number, request) for shard in batch)
            )
        failed = set(job.failed_shards)
        for summary in summaries:
            if summary.failed is None:
                failed.discard(summary.shard)
            else:
                failed.add(summary.shard)
        refreshed: JobSummary = await workflow.execute_activity(
            FINALIZE_JOB,
            FinalizeInput(
                spec=input.spec,
                layout=input.layout,
                summary=job.model_copy(update={"failed_shards": sorted(failed)}),
            ),
            result_type=JobSummary,
            **options.ledger_step(summary=f"re-drive {number}: rewrite manifest", spec=input.spec),
        )
        result = RedriveResult(
            redrive=number,
            requeued=requeued.requeued,
            succeeded=max(0, refreshed.items_succeeded - job.items_succeeded),
            dead=refreshed.items_dead - (job.items_dead - requeued.requeued),
            shards=requeued.shards,
        )
        state.job = refreshed
        state.redrives.append(result)
        return result

    async def _run_shard(self, shard: int, number: int, request: RedriveRequest) -> ShardSummary:
        input = self._input
        summary: ShardSummary = await workflow.execute_child_workflow(
            SHARD_WORKFLOW,
            ShardInput(
                spec=input.spec,
                layout=input.layout,
                shard=shard,
                gpu_task_queue=input.gpu_task_queue,
                generate_schedule_to_start=input.generate_schedule_to_start,
                priority_aging=input.priority_aging,
                redrive=number,
                sampling_overrides=request.sampling,
                prepare_first=True,
            ),
            id=redrive_shard_workflow_id(input.job_id, number, shard),
            result_type=ShardSummary,
            static_summary=f"{input.job_id} re-drive {number}, shard {shard}",
            priority=options.child_priority(input.spec),
        )
        return summary


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])
