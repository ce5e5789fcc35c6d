"""BatchJobWorkflow: plans a job, runs its shards in a bounded window, sums them up."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from llmbatch.contract import search_attributes as sa
    from llmbatch.contract.messages import (
        BatchJobInput,
        FinalizeInput,
        JobControlState,
        JobPausedInput,
        JobProgress,
        JobSummary,
        PlanResult,
        ShardInput,
        ShardSummary,
        final_state,
    )
    from llmbatch.contract.names import (
        BATCH_JOB_WORKFLOW,
        FINALIZE_JOB,
        JOB_FINISHED_SIGNAL,
        PAUSE_UPDATE,
        PLAN_JOB,
        PROGRESS_QUERY,
        RESUME_UPDATE,
        SET_JOB_PAUSED,
        SHARD_FINISHED_SIGNAL,
        SHARD_WORKFLOW,
        dead_letter_workflow_id,
    )
    from llmbatch.contract.spec import JOB_ID_PATTERN

PLAN_TIMEOUT = timedelta(hours=1)
FINALIZE_TIMEOUT = timedelta(minutes=15)
# CPU workers heartbeat every activity in the background (workers/heartbeat.py): a
# killed worker's step is retried after this, not after its whole timeout.
CPU_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Pause and resume give up (and change nothing) if the ledger stays out of reach this long.
CONTROL_TIMEOUT = timedelta(minutes=2)


@workflow.defn(name=BATCH_JOB_WORKFLOW)
class BatchJobWorkflow:
    """The parent of a job; workflow id = job id.

    Shards run as children started with ParentClosePolicy.ABANDON and report back by
    the ``shard_finished`` signal, so this workflow can continue as new at any time
    with shards still running, and its history stays short whatever the job size.
    """

    @workflow.init
    def __init__(self, input: BatchJobInput) -> None:
        _take_workflow_id(input)
        self._reports: list[ShardSummary] = list(input.state.finished)
        self._progress = input.state.progress or JobProgress(
            job_id=input.spec.job_id, model=input.spec.model
        )
        self._state = input.state
        self._finishing = False
        # Pause and resume calls apply one at a time, in the order they came.
        self._control = asyncio.Lock()

    @workflow.signal(name=SHARD_FINISHED_SIGNAL)
    def shard_finished(self, summary: ShardSummary) -> None:
        self._reports.append(summary)

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

    def _check_controllable(self, action: str) -> None:
        p = self._progress
        if self._finishing or p.state == "cancelled":
            ended = "been cancelled" if p.state == "cancelled" else f"finished ({p.state})"
            raise ApplicationError(
                f"cannot {action} job {p.job_id}: it has {ended}",
                type="JobNotRunning",
                non_retryable=True,
            )

    async def _set_paused(self, paused: bool) -> JobControlState:
        async with self._control:
            p = self._progress
            if self._state.plan is not None:
                # The ledger first: a failed write leaves the job as it was.
                await self._write_paused(paused)
            p.paused = paused
            if p.state in ("running", "paused"):
                p.state = "paused" if paused else "running"
            self._publish()
            return JobControlState(job_id=p.job_id, state=p.state, paused=p.paused)

    async def _write_paused(self, paused: bool) -> None:
        # Running generate activities cannot get signals; they read the flag from the
        # ledger. Before planning ends there is nothing running to tell.
        await workflow.execute_activity(
            SET_JOB_PAUSED,
            JobPausedInput(job_id=self._progress.job_id, paused=paused),
            result_type=bool,
            start_to_close_timeout=timedelta(seconds=30),
            schedule_to_close_timeout=CONTROL_TIMEOUT,
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            summary="resume" if not paused else "pause",
        )

    @workflow.run
    async def run(self, input: BatchJobInput) -> JobSummary:
        _take_workflow_id(input)
        spec, state = input.spec, input.state
        _check_job_id(spec.job_id)
        if workflow.info().typed_search_attributes.get(sa.JOB_ID) is None:
            # Started by a Schedule or another language's client: name it for the Web UI.
            workflow.upsert_search_attributes(
                [sa.JOB_ID.value_set(spec.job_id), sa.MODEL.value_set(spec.model)]
            )
        progress = self._progress
        if progress.started_at is None:
            progress.started_at = workflow.now().isoformat()
        retry = RetryPolicy(
            maximum_attempts=spec.retry.max_activity_attempts,
            maximum_interval=timedelta(seconds=60),
            non_retryable_error_types=["InvalidJobSpec"],
        )
        if state.plan is None:
            try:
                state.plan = await workflow.execute_activity(
                    PLAN_JOB,
                    spec,
                    result_type=PlanResult,
                    start_to_close_timeout=PLAN_TIMEOUT,
                    heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
                    retry_policy=retry,
                    summary="list inputs and plan shards",
                )
            except Exception as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, ApplicationError) and cause.type == "InvalidJobSpec":
                    # Surface the validation message itself as the job's failure.
                    raise ApplicationError(
                        cause.message, type="InvalidJobSpec", non_retryable=True
                    ) from err
                raise
            progress.shards_total = state.plan.shard_count
            progress.items_total = state.plan.items_total
            progress.state = "paused" if progress.paused else "running"
            self._publish()
        plan = state.plan

        running = set(progress.shards_running)
        try:
            while True:
                self._count_reports(running)
                while self._may_start_shard(input, running):
                    shard = state.next_shard
                    await self._start_shard(input, plan, shard)
                    running.add(shard)
                    state.next_shard += 1
                    progress.shards_running = sorted(running)
                if not running and state.next_shard >= plan.shard_count:
                    break
                if workflow.info().is_continue_as_new_suggested():
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    self._count_reports(running)
                    state.progress = progress
                    state.finished = []
                    workflow.continue_as_new(BatchJobInput(spec=spec, state=state))
                await workflow.wait_condition(
                    lambda: bool(self._reports) or self._may_start_shard(input, running)
                )
        except asyncio.CancelledError:
            # Abandoned children do not follow the parent's cancellation on their own.
            progress.state = "cancelled"
            for shard in sorted(running):
                await workflow.get_external_workflow_handle(_shard_id(spec.job_id, shard)).cancel()
            await self._end_pause()
            raise

        summary = JobSummary(**progress.model_dump(), output_root=plan.layout.output_root)
        summary.state = final_state(summary)
        summary.finished_at = workflow.now().isoformat()
        self._progress.state = summary.state
        await self._end_pause()
        summary.paused = False
        self._publish()
        summary = await workflow.execute_activity(
            FINALIZE_JOB,
            FinalizeInput(spec=spec, layout=plan.layout, summary=summary),
            result_type=JobSummary,
            start_to_close_timeout=FINALIZE_TIMEOUT,
            heartbeat_timeout=CPU_HEARTBEAT_TIMEOUT,
            retry_policy=retry,
            summary="write manifest",
        )
        self._progress = summary
        self._publish()
        if summary.items_dead:
            # Re-drives wait for this: they must not race the job's own shards.
            await workflow.get_external_workflow_handle(
                dead_letter_workflow_id(spec.job_id)
            ).signal(JOB_FINISHED_SIGNAL, summary)
        return summary

    def _may_start_shard(self, input: BatchJobInput, running: set[int]) -> bool:
        """A free place in the window, a shard left to start, and the job not paused."""
        plan = input.state.plan
        return (
            plan is not None
            and not self._progress.paused
            and len(running) < input.spec.max_concurrent_shards
            and input.state.next_shard < plan.shard_count
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

    async def _start_shard(self, input: BatchJobInput, plan: PlanResult, shard: int) -> None:
        job_id = input.spec.job_id
        try:
            await workflow.start_child_workflow(
                SHARD_WORKFLOW,
                ShardInput(
                    spec=input.spec,
                    layout=plan.layout,
                    shard=shard,
                    gpu_task_queue=plan.gpu_task_queue,
                    parent_workflow_id=workflow.info().workflow_id,
                ),
                id=_shard_id(job_id, shard),
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=f"{job_id} shard {shard} of {plan.shard_count}",
            )
        except WorkflowAlreadyStartedError:
            # Still running from before a continue-as-new: its signal will come.
            pass

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
            f"{p.tokens.completion} completion{self._pace()}"
        )

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
        if p.state in ("running", "paused") and left > 0 and rate > 0:
            pace += f", ETA {_duration(left / rate)}"
        return pace

    def _count_reports(self, running: set[int]) -> None:
        progress = self._progress
        reports, self._reports = self._reports, []
        for report in reports:
            if report.shard not in running:
                continue  # a duplicate report
            running.discard(report.shard)
            progress.shards_done += 1
            progress.items_succeeded += report.succeeded
            progress.items_dead += report.dead
            progress.tokens = progress.tokens + report.tokens
            if report.failed is not None:
                progress.failed_shards.append(report.shard)
        progress.shards_running = sorted(running)
        if reports:
            self._publish()


def _duration(seconds: float) -> str:
    """A short human duration: 45s, 3m10s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _take_workflow_id(input: BatchJobInput) -> None:
    """A spec that leaves the job id out takes the workflow id, so each run of a
    Temporal Schedule ("<schedule>-<scheduled UTC time>") is a job of its own: the
    ledger's key is (job id, item id), and a shared id would find every item done."""
    if not input.spec.job_id:
        input.spec = input.spec.model_copy(update={"job_id": workflow.info().workflow_id})


def _check_job_id(job_id: str) -> None:
    """Job id = workflow id (how status, cancel and the Web UI find a job), and a
    derived one must still be a valid job id."""
    workflow_id = workflow.info().workflow_id
    if job_id != workflow_id:
        raise ApplicationError(
            f"job_id {job_id!r} differs from the workflow id {workflow_id!r}: "
            "start the job with workflow id = job id, or leave job_id out",
            type="InvalidJobSpec",
            non_retryable=True,
        )
    if not re.fullmatch(JOB_ID_PATTERN, job_id):
        raise ApplicationError(
            f"workflow id {job_id!r} is not a valid job id (pattern {JOB_ID_PATTERN})",
            type="InvalidJobSpec",
            non_retryable=True,
        )


def _shard_id(job_id: str, shard: int) -> str:
    return f"{job_id}/shard-{shard:05d}"
