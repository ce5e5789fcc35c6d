"""BatchJobWorkflow: plans a job, runs its shards in a bounded window, sums them up.

In one module on purpose: one workflow is one state machine (the shard window,
pause and resume, an API batch's record and expiry, continue-as-new), and its handlers
read and change the same fields. Split into mixins it would spread that state over
files without making any part of it testable alone; the I/O it drives lives in
activities, the options of each step in ``workflows/options.py``, the rules in ``llmbatch``.
"""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import (
    ApplicationError,
    ChildWorkflowError,
    FailureError,
    WorkflowAlreadyStartedError,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from llmbatch.contract import search_attributes as sa
    from llmbatch.contract.messages import (
        ApiBatchEndInput,
        ApiBatchFiles,
        ApiBatchRecordInput,
        ApiBatchStatusInput,
        BatchJobInput,
        FinalizeInput,
        JobControlState,
        JobEndInput,
        JobPausedInput,
        JobProgress,
        JobSummary,
        PlanResult,
        RunningItems,
        RunningItemsInput,
        ShardInput,
        ShardSummary,
        final_state,
    )
    from llmbatch.contract.names import (
        BATCH_JOB_WORKFLOW,
        COUNT_RUNNING_ITEMS,
        CREATE_API_BATCH_UPDATE,
        FINALIZE_JOB,
        FINISH_API_BATCH,
        JOB_FINISHED_SIGNAL,
        PAUSE_UPDATE,
        PLAN_JOB,
        PROGRESS_QUERY,
        RECORD_API_BATCH,
        RECORD_JOB_END,
        REPORT_BY_SIGNAL,
        RESUME_UPDATE,
        SET_API_BATCH_STATUS,
        SET_JOB_PAUSED,
        SHARD_FINISHED_SIGNAL,
        SHARD_RESULTS,
        SHARD_WORKFLOW,
        dead_letter_workflow_id,
        shard_workflow_id,
    )
    from llmbatch.contract.priority import describe as describe_priority
    from llmbatch.contract.progress import format_duration
    from llmbatch.contract.spec import JOB_ID_PATTERN, JobSpec
    from llmbatch.contract.states import BatchStatus, FailureType, JobState

from llmbatch.workflows import options

_ShardHandle = workflow.ChildWorkflowHandle[Any, ShardSummary]

# How long an API batch's workflow waits for its record (create_api_batch comes with
# the start, in its first task): a start without it ends rather than waiting for ever.
RECORD_WAIT = timedelta(minutes=10)


@workflow.defn(name=BATCH_JOB_WORKFLOW)
class BatchJobWorkflow:
    """The parent of a job; workflow id = job id.

    Shards run as children started with ParentClosePolicy.ABANDON and report back by
    their result. Before this workflow continues as new (which keeps its history
    short whatever the job size), it asks the shards still running to report by the
    ``shard_finished`` signal instead, which reaches the newest run: so it continues
    at any time, with shards still running. Runs from before ``SHARD_RESULTS`` (no
    patch marker) had every shard signal, and still do.

    All of the job's state is ``self._state`` (a :class:`BatchJobState`): the plan,
    the next shard to start, the progress (whose ``shards_running`` is the window)
    and the reports not yet counted. It is what continue-as-new carries.
    """

    @workflow.init
    def __init__(self, input: Any) -> None:
        # The input arrives as plain JSON and is validated here, not by the data
        # converter: a spec the converter refused would fail every workflow task, and
        # the job would hang retrying instead of failing with InvalidJobSpec.
        job, self._input_error = _job_input(input)
        self._spec = _with_job_id(job.spec)
        self._state = job.state
        if self._state.progress is None:
            self._state.progress = JobProgress(
                job_id=self._spec.job_id,
                model=self._spec.model,
                priority=self._spec.priority,
                tenant=self._spec.tenant,
            )
        self._finishing = False
        # An OpenAI Batch API batch's completion window: set when its timer fires.
        self._expired = False
        self._expiry_timer: asyncio.Task[None] | None = None
        # Pause and resume calls apply one at a time, in the order they came.
        self._control = asyncio.Lock()
        # An API batch's record: None until create_api_batch has answered, then
        # whether it was written (False: refused, the job ends without running).
        self._recorded: bool | None = None
        self._record_refusal = ""
        # Shards report by their result (SHARD_RESULTS): set when the run starts. The
        # shards this run started and still runs, each with the task awaiting its result.
        self._by_result = False
        self._children: dict[int, tuple[_ShardHandle, asyncio.Task[None]]] = {}

    @property
    def _progress(self) -> JobProgress:
        assert self._state.progress is not None  # set in __init__
        return self._state.progress

    # --- handlers ---------------------------------------------------------------------

    @workflow.signal(name=SHARD_FINISHED_SIGNAL)
    def shard_finished(self, summary: ShardSummary) -> None:
        self._state.finished.append(summary)

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> JobProgress:
        return self._progress

    @workflow.update(name=PAUSE_UPDATE)
    async def pause(self) -> JobControlState:
        """Start no new shards and no new engine requests; what runs now finishes."""
        return await self._set_paused(True)

    @pause.validator
    def _validate_pause(self) -> None:
        self._check_controllable("pause")

    @workflow.update(name=RESUME_UPDATE)
    async def resume(self) -> JobControlState:
        """Start shards and engine requests again."""
        return await self._set_paused(False)

    @resume.validator
    def _validate_resume(self) -> None:
        self._check_controllable("resume")

    @workflow.update(name=CREATE_API_BATCH_UPDATE)
    async def create_api_batch(self, record: ApiBatchRecordInput) -> None:
        """Write the API batch's record; the API server sends this with the workflow's
        start (Update-with-Start), so a record never exists without its workflow, and
        the server answers only once it does."""
        if self._recorded:
            return  # a retried call: the record is there
        try:
            await workflow.execute_activity(
                RECORD_API_BATCH, record, **options.ledger_step(summary="record the batch")
            )
        except FailureError as err:
            cause = err.cause
            kind: str = FailureType.BATCH_NOT_RECORDED
            if isinstance(cause, ApplicationError):
                self._record_refusal, kind = cause.message, cause.type or kind
            else:
                self._record_refusal = str(err)
            self._recorded = False
            raise ApplicationError(self._record_refusal, type=kind, non_retryable=True) from err
        self._recorded = True

    @create_api_batch.validator
    def _validate_create_api_batch(self, record: ApiBatchRecordInput) -> None:
        if self._spec.api_batch is None or record.batch_id != self._spec.job_id:
            raise ApplicationError(
                "create_api_batch is for the API batch this workflow runs",
                type=FailureType.BATCH_NOT_RECORDED,
            )

    async def _await_record(self) -> None:
        """An API batch runs only once its record is written (by create_api_batch,
        which comes with the start); a start without it, or a refused record, ends the
        job here, before anything ran."""
        if self._spec.api_batch is None or self._state.plan is not None:
            return
        # Histories of batches whose server wrote the record itself replay without it.
        if not workflow.patched(RECORD_API_BATCH):
            return
        try:
            await workflow.wait_condition(
                lambda: self._recorded is not None, timeout=RECORD_WAIT, timeout_summary="record"
            )
        except TimeoutError:
            raise ApplicationError(
                "an API batch's workflow was started without its record",
                type=FailureType.BATCH_NOT_RECORDED,
                non_retryable=True,
            ) from None
        if not self._recorded:
            raise ApplicationError(
                f"batch not recorded: {self._record_refusal}",
                type=FailureType.BATCH_NOT_RECORDED,
                non_retryable=True,
            )

    # --- the job, step by step ----------------------------------------------------------

    @workflow.run
    async def run(self, input: Any) -> JobSummary:
        if self._input_error is not None:
            raise ApplicationError(
                self._input_error, type=FailureType.INVALID_JOB_SPEC, non_retryable=True
            )
        _check_job_id(self._spec.job_id)
        # A signal per shard cost the shard two events and a workflow task, and this
        # workflow one more task, on top of the child's completion it gets anyway.
        self._by_result = workflow.patched(SHARD_RESULTS)
        self._name_for_web_ui()
        await self._await_record()
        if self._progress.started_at is None:
            self._progress.started_at = workflow.now().isoformat()
        try:
            if self._state.plan is None:
                await self._plan()
            await self._run_shards()
            if self._expired:
                return await self._expire()
            return await self._finalize()
        except (asyncio.CancelledError, FailureError) as err:
            if is_cancelled_exception(err):
                # The job's cancel, also when it reached a step in flight (planning,
                # say) and came back as that step's error: Temporal records the job as
                # cancelled when this is raised on. Not a failure.
                await self._cancelled()
                raise
            # Only these fail the workflow (other errors fail a task, which is retried).
            # ContinueAsNewError is a BaseException and passes by.
            await self._record_end(JobState.FAILED)
            if self._is_api_batch():
                # Fenced: a batch that failed validation keeps its errors.
                await self._set_api_batch_status(BatchStatus.FAILED, quiet=True)
            raise

    async def _cancelled(self) -> None:
        """End a cancelled job: its shards cancelled, an API batch's record cancelled
        (OpenAI's cancel keeps what finished: the files hold it), the ledger told."""
        await self._cancel_shards()
        if self._is_api_batch():
            await self._end_api_batch(BatchStatus.CANCELLED, quiet=True)
        await self._record_end(JobState.CANCELLED)

    async def _plan(self) -> None:
        """List the inputs and split them into shards (plans go to storage)."""
        try:
            plan: PlanResult = await workflow.execute_activity(
                PLAN_JOB, self._spec, result_type=PlanResult, **options.plan_step(self._spec)
            )
        except FailureError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == FailureType.INVALID_JOB_SPEC:
                # Surface the validation message itself as the job's failure.
                raise ApplicationError(
                    cause.message, type=FailureType.INVALID_JOB_SPEC, non_retryable=True
                ) from err
            raise
        self._state.plan = plan
        p = self._progress
        p.shards_total, p.items_total = plan.shard_count, plan.items_total
        p.state = JobState.PAUSED if p.paused else JobState.RUNNING
        self._publish()

    async def _run_shards(self) -> None:
        """Keep up to ``max_concurrent_shards`` shards running until all have reported
        (or an API batch's completion window has passed); continue as new whenever
        Temporal suggests it."""
        self._arm_expiry()
        plan = self._state.plan
        # Plans from before progress_every have none: their histories replay as they ran.
        every = plan.progress_every if plan is not None else None
        refresh = asyncio.create_task(self._refresh_progress(every)) if every else None
        try:
            while True:
                if self._expired:
                    return
                self._count_reports()
                while self._may_start_shard():
                    await self._start_next_shard()
                if not self._progress.shards_running and self._all_started():
                    return
                if workflow.info().is_continue_as_new_suggested():
                    await self._continue_as_new()
                await workflow.wait_condition(
                    lambda: bool(self._state.finished) or self._may_start_shard() or self._expired
                )
        finally:
            if refresh is not None:
                refresh.cancel()

    async def _refresh_progress(self, every: timedelta) -> None:
        """Every ``every``, take what the running shards have recorded so far into the
        progress and publish it when it moved: the Web UI's counts then follow the
        items, not only the shards' ends. One timer and one small ledger read a job per
        interval, whatever its size; a read that fails is skipped (the next one comes)."""
        while True:
            await workflow.sleep(every, summary="progress")
            p = self._progress
            if not p.shards_running:
                continue
            try:
                read: RunningItems = await workflow.execute_activity(
                    COUNT_RUNNING_ITEMS,
                    RunningItemsInput(job_id=self._spec.job_id, shards=p.shards_running),
                    result_type=RunningItems,
                    **options.progress_step(self._spec),
                )
            except FailureError as err:
                workflow.logger.info("job %s: progress not read: %s", p.job_id, err)
                continue
            before = (p.items_succeeded, p.items_dead)
            p.take_running_items(read.shards)
            if (p.items_succeeded, p.items_dead) != before:
                self._publish()

    async def _continue_as_new(self) -> None:
        """Hand the state over to a fresh run; running shards report to it (same id)."""
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._hand_over_reports()
        workflow.continue_as_new(BatchJobInput(spec=self._spec, state=self._state))

    async def _hand_over_reports(self) -> None:
        """Ask the shards this run started and still runs to report by signal: their
        results would reach only this run. A shard the ask no longer finds has closed,
        and its result is on its way here: it is awaited, so its report is carried."""
        children = list(self._children.items())
        job = workflow.info().workflow_id
        asked = await asyncio.gather(
            *(handle.signal(REPORT_BY_SIGNAL, job) for _, (handle, _) in children),
            return_exceptions=True,
        )
        for (_, (_, report)), outcome in zip(children, asked, strict=True):
            if isinstance(outcome, BaseException):
                await report

    async def _report_of(self, shard: int, handle: _ShardHandle) -> None:
        """The shard's result, as its report; a shard that ended without one (cancelled
        with the job) is not counted, as it sent no signal before."""
        try:
            summary = await handle
        except (ChildWorkflowError, asyncio.CancelledError) as err:
            workflow.logger.info("shard %s ended without a summary: %s", shard, err)
            return
        finally:
            self._children.pop(shard, None)
        self._state.finished.append(summary)

    async def _cancel_shards(self, state: JobState = JobState.CANCELLED) -> None:
        """Pass the job's cancel on to its running shards: abandoned children do not
        follow their parent's cancellation on their own.

        The cancel reaches a running ``generate`` only with its next heartbeat (up to
        ~24 s, as Temporal throttles them); the ledger's paused flag, which it reads
        every 2 s, holds its engine requests until then. The flag stays set: nothing
        of a cancelled job runs again (re-drives need a job that finished).
        """
        p = self._progress
        p.state = state
        self._publish()
        self._finishing = True
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._state.plan is not None and p.shards_running:
            try:
                await self._write_paused(True)
            except FailureError as err:  # the cancels below still stop the shards
                workflow.logger.warning("job %s: engine requests not held: %s", p.job_id, err)
        for shard in p.shards_running:
            try:
                await workflow.get_external_workflow_handle(
                    shard_workflow_id(self._spec.job_id, shard)
                ).cancel()
            except FailureError as err:  # it closed meanwhile: nothing to cancel
                workflow.logger.info("shard %s not cancelled: %s", shard, err)

    async def _record_end(self, state: JobState) -> None:
        """Put a job that will not finalize in its end state in the ledger's jobs row,
        which would otherwise say ``running`` for ever. Its unfinished items stay
        ``pending``."""
        if self._state.plan is None:
            return  # plan_job writes the row last: a job that ended while planning has none
        # Histories of jobs that ended before this step existed replay without it.
        if not workflow.patched(RECORD_JOB_END):
            return
        self._progress.state = state
        self._publish()
        try:
            await workflow.execute_activity(
                RECORD_JOB_END,
                JobEndInput(
                    job_id=self._spec.job_id, state=state, items_total=self._progress.items_total
                ),
                **options.ledger_step(summary=f"record the job {state}", spec=self._spec),
            )
        except FailureError as err:  # the job's own end must not be hidden by this one
            workflow.logger.warning("job %s: end state not recorded: %s", self._spec.job_id, err)

    async def _finalize(self) -> JobSummary:
        """Count the outcome from the ledger, write the manifest, tell the dead letters."""
        plan = self._state.plan
        assert plan is not None
        summary = JobSummary(**self._progress.model_dump(), output_root=plan.layout.output_root)
        summary.state = final_state(summary)
        summary.finished_at = workflow.now().isoformat()
        self._progress.state = summary.state
        await self._end_pause()
        summary.paused = False
        self._publish()
        api_batch = self._is_api_batch()
        if api_batch:
            await self._set_api_batch_status(BatchStatus.FINALIZING)
        summary = await workflow.execute_activity(
            FINALIZE_JOB,
            FinalizeInput(spec=self._spec, layout=plan.layout, summary=summary),
            result_type=JobSummary,
            **options.cpu_step(self._spec, summary="write manifest"),
        )
        self._state.progress = summary
        self._publish()
        if api_batch:
            await self._end_api_batch(BatchStatus.COMPLETED)
        if summary.items_dead:
            # Re-drives wait for this: they must not race the job's own shards.
            await workflow.get_external_workflow_handle(
                dead_letter_workflow_id(self._spec.job_id)
            ).signal(JOB_FINISHED_SIGNAL, summary)
        return summary

    # --- OpenAI Batch API batches --------------------------------------------------------

    def _is_api_batch(self) -> bool:
        """An OpenAI Batch API batch (``spec.api_batch``), run by code whose steps
        histories from before it lack (a plain job never asks, so its history is
        as it was)."""
        return self._spec.api_batch is not None and workflow.patched(FINISH_API_BATCH)

    def _arm_expiry(self) -> None:
        """Start the timer of an API batch's completion window, counted from the job's
        start (carried across continue-as-new); a passed window expires at once."""
        batch = self._spec.api_batch
        if self._expiry_timer is not None or self._expired or batch is None:
            return
        if self._progress.started_at is None or not self._is_api_batch():
            return
        deadline = datetime.fromisoformat(self._progress.started_at) + timedelta(
            seconds=batch.completion_window_s
        )
        left = deadline - workflow.now()
        if left <= timedelta(0):
            self._expired = True
            return

        async def expire_after() -> None:
            await workflow.sleep(left, summary="completion window")
            self._expired = True

        self._expiry_timer = asyncio.create_task(expire_after())

    async def _expire(self) -> JobSummary:
        """The completion window passed: stop what runs (as cancel does), end the batch
        ``expired`` with the finished results in its files, and the job ``expired``."""
        plan = self._state.plan
        assert plan is not None
        await self._cancel_shards(JobState.EXPIRED)
        files = await self._end_api_batch(BatchStatus.EXPIRED, quiet=True)
        await self._record_end(JobState.EXPIRED)
        # `llm-batch list` reads a closed job's state from here (the workflow completed).
        workflow.upsert_memo({"state": str(JobState.EXPIRED)})
        summary = JobSummary(**self._progress.model_dump(), output_root=plan.layout.output_root)
        summary.state = JobState.EXPIRED
        summary.finished_at = workflow.now().isoformat()
        if files is not None:
            summary.items_succeeded, summary.items_dead = files.succeeded, files.failed
            summary.tokens = files.tokens
        if summary.started_at:
            summary.elapsed_s = (
                workflow.now() - datetime.fromisoformat(summary.started_at)
            ).total_seconds()
        self._state.progress = summary
        self._publish()
        return summary

    async def _set_api_batch_status(self, status: BatchStatus, *, quiet: bool = False) -> None:
        try:
            await workflow.execute_activity(
                SET_API_BATCH_STATUS,
                ApiBatchStatusInput(batch_id=self._spec.job_id, status=status),
                result_type=bool,
                **options.ledger_step(summary=f"batch {status}"),
            )
        except FailureError as err:
            if not quiet:
                raise
            workflow.logger.warning("batch %s: not set %s: %s", self._spec.job_id, status, err)

    async def _end_api_batch(
        self, status: BatchStatus, *, quiet: bool = False
    ) -> ApiBatchFiles | None:
        """Assemble and register the batch's output and error files, and set its final
        ``status``. ``quiet``: on the way out of a cancel or expiry, a failure here is
        logged (the batch is failed) rather than hiding how the job ended."""
        plan = self._state.plan
        if plan is None:  # ended while validating: nothing ran, no files
            await self._set_api_batch_status(status, quiet=quiet)
            return None
        try:
            files: ApiBatchFiles = await workflow.execute_activity(
                FINISH_API_BATCH,
                ApiBatchEndInput(spec=self._spec, layout=plan.layout, status=status),
                result_type=ApiBatchFiles,
                **options.cpu_step(self._spec, summary=f"batch {status}: output and error files"),
            )
        except FailureError as err:
            if not quiet:
                raise
            workflow.logger.warning("batch %s: files not made: %s", self._spec.job_id, err)
            await self._set_api_batch_status(BatchStatus.FAILED, quiet=True)
            return None
        return files

    # --- the shard window ---------------------------------------------------------------

    def _all_started(self) -> bool:
        plan = self._state.plan
        return plan is not None and self._state.next_shard >= plan.shard_count

    def _may_start_shard(self) -> bool:
        """A free place in the window, a shard left to start, and the job not paused."""
        return (
            not self._all_started()
            and not self._expired
            and self._state.plan is not None
            and not self._progress.paused
            and len(self._progress.shards_running) < self._spec.max_concurrent_shards
        )

    async def _start_next_shard(self) -> None:
        plan, p = self._state.plan, self._progress
        assert plan is not None
        shard = self._state.next_shard
        # In the window before the start is awaited: a cancel that comes meanwhile
        # must reach this shard too.
        p.shards_running = sorted([*p.shards_running, shard])
        self._state.next_shard += 1
        try:
            handle = await workflow.start_child_workflow(
                SHARD_WORKFLOW,
                ShardInput(
                    spec=self._spec,
                    layout=plan.layout,
                    shard=shard,
                    gpu_task_queue=plan.gpu_task_queue,
                    generate_schedule_to_start=plan.generate_schedule_to_start,
                    priority_aging=plan.priority_aging,
                    # Set, the shard signals its summary (runs from before SHARD_RESULTS).
                    parent_workflow_id=None if self._by_result else workflow.info().workflow_id,
                    prepare_first=True,
                ),
                id=shard_workflow_id(self._spec.job_id, shard),
                result_type=ShardSummary,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=f"{self._spec.job_id} shard {shard} of {plan.shard_count}",
                priority=options.child_priority(self._spec),
            )
        except WorkflowAlreadyStartedError:
            return  # still running from before a continue-as-new: its signal will come
        if self._by_result:
            self._children[shard] = (handle, asyncio.create_task(self._report_of(shard, handle)))

    def _count_reports(self) -> None:
        p = self._progress
        reports, self._state.finished = self._state.finished, []
        running = set(p.shards_running)
        for report in reports:
            if report.shard not in running:
                continue  # a duplicate report
            running.discard(report.shard)
            p.count_shard_report(report)
            if report.failed is not None:
                p.failed_shards.append(report.shard)
        p.shards_running = sorted(running)
        if reports:
            self._publish()

    # --- pause and resume ---------------------------------------------------------------

    def _check_controllable(self, action: str) -> None:
        p = self._progress
        if self._finishing or p.state == JobState.CANCELLED:
            ended = "been cancelled" if p.state == JobState.CANCELLED else f"finished ({p.state})"
            raise ApplicationError(
                f"cannot {action} job {p.job_id}: it has {ended}",
                type=FailureType.JOB_NOT_RUNNING,
                non_retryable=True,
            )

    async def _set_paused(self, paused: bool) -> JobControlState:
        async with self._control:
            p = self._progress
            if self._state.plan is not None:
                # The ledger first: a failed write leaves the job as it was.
                await self._write_paused(paused)
            p.paused = paused
            if p.state in (JobState.RUNNING, JobState.PAUSED):
                p.state = JobState.PAUSED if paused else JobState.RUNNING
            self._publish()
            return JobControlState(job_id=p.job_id, state=p.state, paused=p.paused)

    async def _write_paused(self, paused: bool) -> None:
        # Running generate activities cannot get signals; they read the flag from the
        # ledger. Before planning ends there is nothing running to tell.
        await workflow.execute_activity(
            SET_JOB_PAUSED,
            JobPausedInput(job_id=self._progress.job_id, paused=paused),
            result_type=bool,
            **options.control_step(summary="pause" if paused else "resume", spec=self._spec),
        )

    async def _end_pause(self) -> None:
        """Refuse further pause/resume, let those under way finish, and clear the
        ledger's paused flag, so a later re-drive of this job's items never waits."""
        self._finishing = True
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._progress.paused and self._state.plan is not None:
            try:
                await self._write_paused(False)
            except Exception:
                workflow.logger.warning("job %s: paused flag not cleared", self._progress.job_id)
        self._progress.paused = False

    # --- what the Web UI shows ------------------------------------------------------------

    def _name_for_web_ui(self) -> None:
        attributes = workflow.info().typed_search_attributes
        if attributes.get(sa.JOB_ID) is None:
            # Started by a Schedule or another language's client: name it for the Web UI.
            workflow.upsert_search_attributes(
                [sa.JOB_ID.value_set(self._spec.job_id), sa.MODEL.value_set(self._spec.model)]
            )
        # Only for specs that set them, so a job without them (every job from before
        # they existed) replays with the same commands.
        missing: list[SearchAttributeUpdate[Any]] = []
        if self._spec.priority is not None and attributes.get(sa.JOB_PRIORITY) is None:
            missing.append(sa.JOB_PRIORITY.value_set(str(self._spec.priority)))
        if self._spec.tenant is not None and attributes.get(sa.TENANT) is None:
            missing.append(sa.TENANT.value_set(self._spec.tenant))
        if missing:
            workflow.upsert_search_attributes(missing)

    def _publish(self) -> None:
        """Coarse progress for the Web UI: search attributes to filter and sort jobs by,
        and the details line on the job's page. Counts only, never row data."""
        p = self._progress
        workflow.upsert_search_attributes(
            [
                sa.ITEMS_TOTAL.value_set(p.items_total),
                sa.ITEMS_DONE.value_set(p.items_done),
                sa.ITEMS_DEAD.value_set(p.items_dead),
            ]
        )
        workflow.set_current_details(
            f"**{p.state}**: shards {p.shards_done}/{p.shards_total} done, "
            f"running {len(p.shards_running)}; items {p.items_done}/{p.items_total} done "
            f"({p.items_dead} dead); tokens {p.tokens.prompt} prompt, "
            f"{p.tokens.completion} completion{self._pace()}{self._place()}"
            # Where results came from, GPU time and cost (shards that finished so far).
            + (f"; {p.usage.describe()}" if p.usage.generated or p.usage.reused else "")
        )

    def _place(self) -> str:
        """The job's priority and tenant, when its spec sets them."""
        place = describe_priority(self._spec)
        return f"; {place}" if place else ""

    def _pace(self) -> str:
        """Throughput since the job started and, while it runs, the time left at that
        rate; from workflow time, so replays compute the same line."""
        p = self._progress
        if p.started_at is None:
            return ""
        elapsed = (workflow.now() - datetime.fromisoformat(p.started_at)).total_seconds()
        if elapsed <= 0:
            return ""
        rate = p.items_done / elapsed
        pace = f"; {rate:.1f} items/s"
        left = p.items_total - p.items_done
        if p.state in (JobState.RUNNING, JobState.PAUSED) and left > 0 and rate > 0:
            pace += f", ETA {format_duration(left / rate)}"
        return pace


def _job_input(raw: Any) -> tuple[BatchJobInput, str | None]:
    """The validated input, or a stand-in (so queries still answer) and why it is not
    valid, in one line."""
    try:
        return BatchJobInput.model_validate(raw), None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors()
        )
        spec = raw.get("spec", raw) if isinstance(raw, dict) else None  # or a bare spec
        model = spec.get("model") if isinstance(spec, dict) else None
        stand_in = JobSpec.model_construct(
            job_id="", inputs=[], model=model if isinstance(model, str) else "", output_uri=""
        )
        return BatchJobInput.model_construct(spec=stand_in), f"invalid job: {problems}"


def _with_job_id(spec: JobSpec) -> JobSpec:
    """A spec that leaves the job id out takes the workflow id, so each run of a
    Temporal Schedule ("<schedule>-<scheduled UTC time>") is a job of its own: the
    ledger's key is (job id, item id), and a shared id would find every item done."""
    if spec.job_id:
        return spec
    return spec.model_copy(update={"job_id": workflow.info().workflow_id})


def _check_job_id(job_id: str) -> None:
    """Job id = workflow id (how status, cancel and the Web UI find a job), and a
    derived one must still be a valid job id."""
    workflow_id = workflow.info().workflow_id
    if job_id != workflow_id:
        raise ApplicationError(
            f"job_id {job_id!r} differs from the workflow id {workflow_id!r}: "
            "start the job with workflow id = job id, or leave job_id out",
            type=FailureType.INVALID_JOB_SPEC,
            non_retryable=True,
        )
    if not re.fullmatch(JOB_ID_PATTERN, job_id):
        raise ApplicationError(
            f"workflow id {job_id!r} is not a valid job id (pattern {JOB_ID_PATTERN})",
            type=FailureType.INVALID_JOB_SPEC,
            non_retryable=True,
        )
