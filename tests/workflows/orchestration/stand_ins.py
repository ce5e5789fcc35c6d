"""Activity stand-ins: they replace the real activities to test orchestration alone.

Each stand-in is registered under the real activity's name (``llmbatch.contract.names``)
and takes and returns the real messages, but touches no Postgres, S3 or vLLM. Instead
a small in-memory ledger (one :class:`ShardBook` per shard) gives canned answers
computed from the shard number, so a test knows every count in advance.

What these tests prove is what the workflows decide: which steps run, how often, in
which order, with what concurrency, and how the results are summed. The real-stack
tests beside them (``tests/workflows/test_*.py``) prove that the whole works.

A test can also steer timing exactly: :meth:`StandIns.close_gate` makes a stand-in
wait (heartbeating, so a cancel reaches it) until the test opens the gate, and
:meth:`StandIns.until` waits for a condition on the recorded calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import activity
from temporalio.common import Priority
from temporalio.exceptions import ApplicationError

from llmbatch.client import dead_letters as dead_letter_client
from llmbatch.contract.dead_letters import (
    FailShardInput,
    RequeueInput,
    RequeueResult,
    ShardDeadLetters,
)
from llmbatch.contract.messages import (
    ApiBatchEndInput,
    ApiBatchFiles,
    ApiBatchRecordInput,
    ApiBatchStatusInput,
    FinalizeInput,
    GenerateResult,
    JobEndInput,
    JobLayout,
    JobPausedInput,
    JobSummary,
    PlanResult,
    PrepareResult,
    RunningItems,
    RunningItemsInput,
    ShardCounts,
    ShardInput,
    ShardSummary,
    TokenCounts,
    final_state,
)
from llmbatch.contract.names import (
    COUNT_RUNNING_ITEMS,
    FAIL_SHARD,
    FINALIZE_JOB,
    FINISH_API_BATCH,
    GENERATE,
    PLAN_JOB,
    PREPARE_SHARD,
    RECORD_API_BATCH,
    RECORD_JOB_END,
    REPORT_DEAD_LETTERS,
    REQUEUE_DEAD_LETTERS,
    SET_API_BATCH_STATUS,
    SET_JOB_PAUSED,
    WRITE_SHARD,
)
from llmbatch.contract.spec import InputFormat, JobSpec
from llmbatch.contract.states import ErrorClass, FailureType

# Tokens each succeeded item costs, so a job's token count is known in advance.
PROMPT_TOKENS_PER_ITEM = 10
COMPLETION_TOKENS_PER_ITEM = 2
# Why a stand-in's items die in generate.
DEAD_CLASS = ErrorClass.PROMPT_TOO_LONG
# What a failing stand-in raises: non-retryable, so the shard fails at once.
FAILURE_TYPE = "StorageUnavailable"
FAILURE_MESSAGE = "the object store is gone"
# A stand-in waiting at a gate heartbeats this often (the test workers flush
# heartbeats at once), so a cancel reaches it within a fraction of a second.
HEARTBEAT_EVERY = timedelta(milliseconds=50)
# How the plan_job stand-in refuses an API batch whose file "fails validation".
INVALID_BATCH_MESSAGE = "the batch input file is invalid: line 2: invalid_json_line"
# Only a guard against a hang: conditions are waited for, never timed.
GUARD_S = 60.0


def rows_of(shard: int) -> int:
    """How many rows shard ``shard`` has: 3, 4, 5, 3, 4, 5, ..."""
    return 3 + shard % 3


def tokens_for(succeeded: int) -> TokenCounts:
    return TokenCounts(
        prompt=succeeded * PROMPT_TOKENS_PER_ITEM,
        completion=succeeded * COMPLETION_TOKENS_PER_ITEM,
    )


@dataclass
class ShardBook:
    """One shard's items in the stand-in ledger: pending, succeeded or dead (by class)."""

    rows: int
    pending: int
    succeeded: int = 0
    dead_by_class: dict[ErrorClass, int] = field(default_factory=dict)

    @property
    def dead(self) -> int:
        return sum(self.dead_by_class.values())

    def kill_pending(self, error_class: ErrorClass, n: int) -> int:
        n = min(n, self.pending)
        if n:
            self.pending -= n
            self.dead_by_class[error_class] = self.dead_by_class.get(error_class, 0) + n
        return n

    def counts(self, marked: int = 0) -> ShardCounts:
        return ShardCounts(
            succeeded=self.succeeded,
            dead=self.dead,
            tokens=tokens_for(self.succeeded),
            marked=marked,
        )


@dataclass(frozen=True)
class Call:
    """One call of a stand-in. ``shard`` is None for job-level steps; ``redrive`` is
    the re-drive number of the shard run (0 for the job's own run); ``event`` tells
    the moments of a call apart ("start", "done", "cancelled", "cancel-ignored");
    ``priority`` is the task-queue priority the activity task came with (starts only)."""

    step: str
    shard: int | None
    redrive: int = 0
    event: str = "start"
    detail: object = None
    priority: Priority | None = None


class StandIns:
    """The activities of one job, replaced by canned, recorded answers.

    ``dead`` says how many items of a shard die in its job run's generate,
    ``redrive_dead`` how many of its requeued items die again in a re-drive;
    ``failures`` lists (step, shard) pairs whose stand-in raises a non-retryable
    error; ``ignore_cancel`` lists (step, shard) pairs whose stand-in, cancelled while
    it waits at its gate, returns normally anyway; ``invalid_batch`` makes plan_job
    refuse an API batch as its validation would.
    """

    def __init__(
        self,
        *,
        shards: int,
        gpu_task_queue: str,
        dead: Mapping[int, int] | None = None,
        redrive_dead: Mapping[int, int] | None = None,
        failures: Iterable[tuple[str, int]] = (),
        ignore_cancel: Iterable[tuple[str, int]] = (),
        invalid_batch: bool = False,
        progress_every: timedelta | None = None,
    ) -> None:
        self.shards = shards
        self.progress_every = progress_every
        # What count_running_items answers, by shard: set by a test while shards run.
        self.recorded: dict[int, ShardCounts] = {}
        self.invalid_batch = invalid_batch
        self.gpu_task_queue = gpu_task_queue
        self.dead = dict(dead or {})
        self.redrive_dead = dict(redrive_dead or {})
        self.failures = set(failures)
        self.ignore_cancel = set(ignore_cancel)
        self.books: dict[int, ShardBook] = {}
        self.calls: list[Call] = []
        self.in_flight: set[int] = set()
        self.max_in_flight = 0
        self._gates: dict[tuple[str, int | None], asyncio.Event] = {}
        self._changed = asyncio.Condition()

    # --- what tests use ------------------------------------------------------------------

    @property
    def items_total(self) -> int:
        return sum(rows_of(s) for s in range(self.shards))

    def close_gate(self, step: str, shard: int | None = None) -> None:
        """Make ``step`` (of ``shard``) wait, once called, until :meth:`open_gate`."""
        self._gates[(step, shard)] = asyncio.Event()

    def open_gate(self, step: str, shard: int | None = None) -> None:
        self._gates[(step, shard)].set()

    def called(
        self, step: str, shard: int | None = None, *, redrive: int = 0, event: str = "start"
    ) -> list[Call]:
        return [
            c
            for c in self.calls
            if (c.step, c.shard, c.redrive, c.event) == (step, shard, redrive, event)
        ]

    def shards_at(self, step: str, *, redrive: int = 0) -> list[int]:
        """The shards that started ``step``, in the order they did."""
        return [
            c.shard
            for c in self.calls
            if (c.step, c.redrive, c.event) == (step, redrive, "start") and c.shard is not None
        ]

    def steps_of(self, shard: int, *, redrive: int = 0) -> list[str]:
        """The steps shard ``shard`` started, in order."""
        return [
            c.step
            for c in self.calls
            if c.shard == shard and c.redrive == redrive and c.event == "start"
        ]

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition`` holds (checked whenever a stand-in is called)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(condition), GUARD_S)

    async def until_called(
        self, step: str, shard: int | None = None, *, redrive: int = 0, event: str = "start"
    ) -> None:
        await self.until(lambda: bool(self.called(step, shard, redrive=redrive, event=event)))

    def activities(self) -> list[Callable[..., object]]:
        """Every stand-in but generate: what the CPU worker registers."""
        return [
            self.plan_job,
            self.prepare_shard,
            self.write_shard,
            self.finalize_job,
            self.record_job_end,
            self.set_job_paused,
            self.fail_shard,
            self.report_dead_letters,
            self.requeue_dead_letters,
            self.record_api_batch,
            self.set_api_batch_status,
            self.finish_api_batch,
            self.count_running_items,
        ]

    # --- the stand-ins ---------------------------------------------------------------------

    @activity.defn(name=PLAN_JOB)
    async def plan_job(self, spec: JobSpec) -> PlanResult:
        await self._step(PLAN_JOB, None)
        if self.invalid_batch and spec.api_batch is not None:
            raise ApplicationError(
                INVALID_BATCH_MESSAGE, type=FailureType.INVALID_JOB_SPEC, non_retryable=True
            )
        return PlanResult(
            layout=JobLayout(
                job_id=spec.job_id,
                output_root=f"{spec.output_uri}/{spec.job_id}",
                input_format=InputFormat.JSONL,
            ),
            shard_count=self.shards,
            items_total=self.items_total,
            gpu_task_queue=self.gpu_task_queue,
            progress_every=self.progress_every,
        )

    @activity.defn(name=COUNT_RUNNING_ITEMS)
    async def count_running_items(self, input: RunningItemsInput) -> RunningItems:
        await self._record(Call(COUNT_RUNNING_ITEMS, None, detail=list(input.shards)))
        return RunningItems(
            shards={s: self.recorded[s] for s in input.shards if s in self.recorded}
        )

    @activity.defn(name=PREPARE_SHARD)
    async def prepare_shard(self, input: ShardInput) -> PrepareResult:
        if not input.redrive:
            self.in_flight.add(input.shard)
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        await self._step(PREPARE_SHARD, input.shard, input.redrive)
        book = self._book(input.shard)
        return PrepareResult(
            rows=book.rows, invalid=0, to_generate=book.pending, already_done=book.succeeded, dead=0
        )

    @activity.defn(name=GENERATE)
    async def generate(self, input: ShardInput) -> GenerateResult:
        await self._step(GENERATE, input.shard, input.redrive)
        book = self._book(input.shard)
        to_die = (self.redrive_dead if input.redrive else self.dead).get(input.shard, 0)
        dead = book.kill_pending(DEAD_CLASS, to_die)
        generated, book.pending = book.pending, 0
        book.succeeded += generated
        return GenerateResult(
            generated=generated, dead=dead, skipped=0, tokens=tokens_for(generated)
        )

    @activity.defn(name=WRITE_SHARD)
    async def write_shard(self, input: ShardInput) -> ShardSummary:
        await self._step(WRITE_SHARD, input.shard, input.redrive)
        book = self._book(input.shard)
        if not input.redrive:
            self.in_flight.discard(input.shard)
        return ShardSummary(
            shard=input.shard,
            items=book.rows,
            succeeded=book.succeeded,
            dead=book.dead,
            tokens=tokens_for(book.succeeded),
            output_parts=[f"{input.layout.output_root}/part-{input.shard:05d}.jsonl"],
        )

    @activity.defn(name=FINALIZE_JOB)
    async def finalize_job(self, input: FinalizeInput) -> JobSummary:
        """The summary it was given, with the counts of the ledger (as the real one)."""
        await self._step(FINALIZE_JOB, None, detail=input.summary)
        summary = input.summary.model_copy()
        books = self.books.values()
        summary.items_succeeded = sum(b.succeeded for b in books)
        summary.items_dead = sum(b.dead for b in books)
        summary.tokens = tokens_for(summary.items_succeeded)
        summary.state = final_state(summary)
        summary.manifest = input.layout.manifest
        return summary

    @activity.defn(name=RECORD_JOB_END)
    async def record_job_end(self, input: JobEndInput) -> None:
        """Records the end state it was given (``detail``), as the real one does in the
        jobs row."""
        await self._step(RECORD_JOB_END, None, detail=input.state)

    @activity.defn(name=RECORD_API_BATCH)
    async def record_api_batch(self, input: ApiBatchRecordInput) -> None:
        """Writes nothing (no batch table here) and records no call: the record is the
        start's, not a step of the job."""

    @activity.defn(name=SET_API_BATCH_STATUS)
    async def set_api_batch_status(self, input: ApiBatchStatusInput) -> bool:
        """Records the status it was given (``detail``)."""
        await self._step(SET_API_BATCH_STATUS, None, detail=input.status)
        return True

    @activity.defn(name=FINISH_API_BATCH)
    async def finish_api_batch(self, input: ApiBatchEndInput) -> ApiBatchFiles:
        """Records how the batch ends (``detail``); as the real one, every request not
        succeeded is in the error file."""
        await self._step(FINISH_API_BATCH, None, detail=input.status)
        succeeded = sum(b.succeeded for b in self.books.values())
        return ApiBatchFiles(
            output_file_id="file-out" if succeeded else None,
            error_file_id="file-err" if succeeded < self.items_total else None,
            succeeded=succeeded,
            failed=self.items_total - succeeded,
            tokens=tokens_for(succeeded),
        )

    @activity.defn(name=SET_JOB_PAUSED)
    async def set_job_paused(self, input: JobPausedInput) -> bool:
        await self._step(SET_JOB_PAUSED, None, detail=input.paused)
        return True

    @activity.defn(name=FAIL_SHARD)
    async def fail_shard(self, input: FailShardInput) -> ShardCounts:
        """Every item of the shard not yet done dies with the shard's reason."""
        await self._step(FAIL_SHARD, input.shard, detail=input)
        book = self._book(input.shard)
        self.in_flight.discard(input.shard)
        marked = book.kill_pending(input.error_class, book.pending)
        return book.counts(marked)

    @activity.defn(name=REPORT_DEAD_LETTERS)
    async def report_dead_letters(self, input: ShardInput) -> int:
        """Signal-with-start the job's DeadLetterWorkflow through the real activity's own
        call (llmbatch.client.dead_letters), so the two start it alike."""
        await self._step(REPORT_DEAD_LETTERS, input.shard, input.redrive)
        book = self._book(input.shard)
        report = ShardDeadLetters(shard=input.shard, by_class=book.dead_by_class)
        await dead_letter_client.report_dead_letters(
            activity.client(), input=input, report=report, task_queue=activity.info().task_queue
        )
        await self._record(Call(REPORT_DEAD_LETTERS, input.shard, input.redrive, "done"))
        return book.dead

    @activity.defn(name=REQUEUE_DEAD_LETTERS)
    async def requeue_dead_letters(self, input: RequeueInput) -> RequeueResult:
        """Dead items of the chosen classes (all by default) become pending again."""
        await self._step(REQUEUE_DEAD_LETTERS, None, detail=input)
        assert input.item_ids is None, "the stand-in ledger has no item ids"
        requeued, shards = 0, []
        for shard, book in sorted(self.books.items()):
            n = 0
            for error_class in list(book.dead_by_class):
                if input.error_classes is None or error_class in input.error_classes:
                    n += book.dead_by_class.pop(error_class)
            if n:
                book.pending += n
                requeued += n
                shards.append(shard)
        return RequeueResult(requeued=requeued, shards=shards)

    # --- machinery ---------------------------------------------------------------------------

    def _book(self, shard: int) -> ShardBook:
        if shard not in self.books:
            rows = rows_of(shard)
            self.books[shard] = ShardBook(rows=rows, pending=rows)
        return self.books[shard]

    async def _record(self, call: Call) -> None:
        async with self._changed:
            self.calls.append(call)
            self._changed.notify_all()

    async def _step(
        self, step: str, shard: int | None, redrive: int = 0, *, detail: object = None
    ) -> None:
        """Record the call, wait at the step's gate if the test closed it, and fail if
        the test asked for that (job runs only: a re-drive's steps do not fail)."""
        await self._record(Call(step, shard, redrive, "start", detail, activity.info().priority))
        gate = self._gates.get((step, shard))
        if gate is not None and not redrive:
            try:
                while not gate.is_set():
                    activity.heartbeat()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gate.wait(), HEARTBEAT_EVERY.total_seconds())
            except asyncio.CancelledError:
                if shard is None or (step, shard) not in self.ignore_cancel:
                    await self._record(Call(step, shard, redrive, "cancelled"))
                    raise
                # Finish normally although the cancel has come (a generate about to end).
                await self._record(Call(step, shard, redrive, "cancel-ignored"))
        if shard is not None and (step, shard) in self.failures and not redrive:
            raise ApplicationError(FAILURE_MESSAGE, type=FAILURE_TYPE, non_retryable=True)
