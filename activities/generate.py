"""generate: run a shard's requests through the worker's engine.

Runs on the GPU queue. Results go to the ledger in batches, fenced by this
attempt's lease, so a retried attempt picks up exactly what is not done yet and a
stale attempt (one that outlived its heartbeat timeout) cannot overwrite it.

This module keeps the activity, its pause gate and its heartbeat; recording results
is :mod:`llmbatch.generation.recorder`'s, deduplication
:mod:`llmbatch.dedup.coordination`'s, and the engine is any
:class:`llmbatch.engine.base.BatchEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

from opentelemetry.trace import Span
from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch import ledger, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.drain import Drain, drained, finish_before_cancel, unless_draining, watch
from llmbatch.activities.heartbeat import heartbeat_interval
from llmbatch.contract.messages import GenerateProgress, GenerateResult, ShardInput
from llmbatch.contract.names import GENERATE, model_identity
from llmbatch.contract.spec import JobSpec, Task
from llmbatch.contract.states import FailureType
from llmbatch.dedup.coordination import (
    LEAD_WAIT_LIMIT_SECONDS,
    Group,
    Leads,
    groups_to_run,
)
from llmbatch.engine.base import BatchEngine, EngineUsage
from llmbatch.engine.errors import EndpointRefusedError, engine_dead
from llmbatch.engine.requests import (
    EmbeddingRequest,
    GenerationRequest,
)
from llmbatch.formats.records import StagedRequest, load_jsonl
from llmbatch.generation.recorder import EmbedRecorder, Recorder
from llmbatch.remote.pause import pause_job

log = logging.getLogger(__name__)


# How often a running attempt reads its job's paused flag from the ledger.
PAUSE_CHECK_EVERY_SECONDS = 2.0


# How often a shard waiting for another shard's result of the same request looks.
LEAD_POLL_SECONDS = 0.5


class GenerateActivities:
    def __init__(
        self,
        ctx: ActivityContext,
        engine: BatchEngine,
        *,
        max_in_flight: int,
        on_engine_dead: Callable[[BaseException], None] | None = None,
        task: Task = Task.GENERATE,
        drain: Drain | None = None,
    ) -> None:
        self._ctx = ctx
        # Shared by the worker's activities; without one, a worker shutdown aborts at
        # once (a drain timeout of 0), as Temporal's default graceful timeout has it.
        self._drain = drain or Drain(timeout=timedelta(0))
        self._engine = engine
        self._max_in_flight = max_in_flight
        self._on_engine_dead = on_engine_dead
        # The task the engine was built for: an embed worker's engine is vLLM's pooling
        # runner, and the same activity loop drives it (see EmbedRecorder).
        self._task = task

    @activity.defn(name=GENERATE)
    async def generate(self, input: ShardInput) -> GenerateResult:
        """Generate every request of the shard that the ledger does not have yet."""
        info = activity.info()
        holder = f"{info.workflow_id}/{info.activity_id}"
        lease = f"{holder}#{info.attempt}"
        progress = (
            GenerateProgress.model_validate(info.heartbeat_details[0])
            if info.heartbeat_details
            else GenerateProgress()
        )
        job_id = input.spec.job_id
        self._check_model(input)
        requests = await self._read_requests(input)
        # Fenced by attempt: a stale attempt that starts late takes nothing from a newer one.
        claimed = await ledger.items.claim_items(
            self._ctx.pool,
            job_id=job_id,
            item_ids=list(requests),
            lease_owner=lease,
            activity=holder,
            attempt=info.attempt,
        )
        todo = [r for r in requests.values() if r.item_id in claimed]
        usage = EngineUsage()
        recorder = (EmbedRecorder if self._embed else Recorder)(
            self._ctx, input, lease, progress, [], usage=usage, engine=self._engine
        )
        timeout = info.heartbeat_timeout
        leads = Leads(
            self._ctx,
            job_id,
            lease,
            recorder,
            shard=input.shard,
            heartbeat_timeout_s=timeout.total_seconds() if timeout else None,
        )
        queue = _Queue(leads, recorder, _PauseGate(self._ctx, job_id), self._drain)
        heartbeat = asyncio.create_task(_heartbeat_loop(progress, renew=leads.renew))
        engine_span = self._engine_span(input, requests=len(todo))
        try:
            await queue.fill(await self._groups(input.spec, todo, recorder))
            aborted = await self._run_engine(queue.requests(), recorder, usage)
            if self._drain.draining and (queue.left or aborted):
                await self._hand_back(recorder, progress, lease, claimed, aborted=aborted)
        except asyncio.CancelledError:
            # The job was cancelled. Closing generate_many has aborted the engine
            # requests by now; keep what came back, give back the rest.
            # Cancelled by the worker's own stop (the drain's window ran out before the
            # hand-back was done) is the stop's doing, not the items': no attempt counted.
            stopping = self._drain.draining
            released = await asyncio.shield(
                _give_back(self._ctx, recorder, job_id, lease, claimed, refund=stopping)
            )
            if stopping:
                # Said as a drained attempt says it: what a stop cost must not depend on
                # whether the hand-back beat the SDK's cancel (on a starved CPU it may not).
                self._log_drained(
                    lease, recorder, released, aborted=self._drain.past_deadline, cut_short=True
                )
            raise
        except EndpointRefusedError as exc:
            # Every item would fail the same way (a wrong key, a model the endpoint
            # does not serve): pause the job, give its items back, and let Temporal
            # retry this attempt, which waits while the job is paused.
            await asyncio.shield(_refused(self._ctx, recorder, job_id, lease, claimed, exc))
            raise ApplicationError(
                f"{exc}; job {job_id} paused", type=FailureType.ENDPOINT_REFUSED
            ) from None
        except Exception as exc:
            if engine_dead(exc) and self._on_engine_dead is not None:
                self._on_engine_dead(exc)
            raise
        finally:
            heartbeat.cancel()
            recorder.end_span(engine_span)
        activity.heartbeat(progress.model_dump())
        return GenerateResult(
            generated=recorder.succeeded,
            dead=recorder.dead,
            skipped=len(requests) - len(todo),
            tokens=recorder.tokens,
        )

    @property
    def _embed(self) -> bool:
        return self._task is Task.EMBED

    async def _read_requests(self, input: ShardInput) -> dict[str, StagedRequest]:
        """The shard's rendered requests, by item id."""
        spec = input.spec
        with telemetry.span(
            "generate.read_requests", job_id=spec.job_id, model=spec.model, shard=input.shard
        ) as read_span:
            staged = await self._ctx.read(input.layout.shard_requests(input.shard))
            requests = {r.item_id: r for r in load_jsonl(staged, StagedRequest)}
            read_span.set_attributes(telemetry.attrs(bytes=len(staged), rows=len(requests)))
        return requests

    async def _groups(
        self, spec: JobSpec, todo: list[StagedRequest], recorder: Recorder
    ) -> list[Group]:
        """Identical requests of the shard in one group, then what the result cache
        answers recorded as such; what is left goes to the queue."""
        return await groups_to_run(
            self._ctx, spec, todo, recorder, weights=self._engine.weights, embed=self._embed
        )

    def _engine_span(self, input: ShardInput, *, requests: int) -> Span:
        # One span for the shard's engine work, not one per request: a job of millions
        # of rows would flood the exporter. Per-request latency goes to a histogram.
        return telemetry.tracer().start_span(
            "generate.engine",
            attributes=telemetry.attrs(
                job_id=input.spec.job_id,
                model=input.spec.model,
                shard=input.shard,
                requests=requests,
                max_in_flight=self._max_in_flight,
            ),
        )

    async def _run_engine(
        self,
        requests: AsyncIterator[GenerationRequest | EmbeddingRequest],
        recorder: Recorder,
        usage: EngineUsage,
    ) -> bool:
        """Every request through the engine, results recorded as they come; return
        whether a drain's deadline aborted requests still in flight."""
        # One loop for both tasks: the engine call differs, nothing else.
        run_many: Any = self._engine.embed_many if self._embed else self._engine.generate_many
        results = run_many(requests, max_in_flight=self._max_in_flight, usage=usage)
        # On a drain, requests in flight run until shortly before its deadline, then
        # they are aborted (the timeout cancels the loop, closing ``results``).
        deadline = asyncio.timeout(None)
        try:
            async with deadline:
                watching = asyncio.create_task(watch(self._drain, deadline))
                try:
                    async with contextlib.aclosing(results):
                        async for result in results:
                            recorder.add(result)
                            if recorder.due():
                                await finish_before_cancel(recorder.flush())
                finally:
                    watching.cancel()
        except TimeoutError:
            if not deadline.expired():
                raise
        await recorder.flush()
        return deadline.expired()

    async def _hand_back(
        self,
        recorder: Recorder,
        progress: GenerateProgress,
        lease: str,
        claimed: set[str],
        *,
        aborted: bool,
    ) -> None:
        """End a drained attempt: what it recorded stays, its unfinished items go back
        without the attempt counted against them, and the step is retried elsewhere."""
        released = await ledger.items.release_items(
            self._ctx.pool,
            job_id=recorder.job_id,
            lease_owner=lease,
            item_ids=list(claimed),
            refund=True,
        )
        activity.heartbeat(progress.model_dump())
        self._log_drained(lease, recorder, released, aborted=aborted)
        raise drained(
            f"worker stopped; {released} unfinished items of this shard given back, "
            f"{recorder.succeeded + recorder.dead} recorded"
        )

    def _log_drained(
        self,
        lease: str,
        recorder: Recorder,
        released: int | None,
        *,
        aborted: bool,
        cut_short: bool = False,
    ) -> None:
        # A warning: it is seldom, and an operator wants to see what a stop cost.
        log.warning(
            "attempt %s drained in %.1f s: %d results recorded, %s items given back%s%s",
            lease,
            self._drain.seconds_since_begun(),
            recorder.succeeded + recorder.dead,
            "unknown" if released is None else released,
            " (in-flight requests aborted at the drain deadline)" if aborted else "",
            " (the worker's stop cancelled the attempt before it handed back)" if cut_short else "",
        )

    def _check_model(self, input: ShardInput) -> None:
        """Refuse a shard for another model than the one loaded, before touching any
        item: queue names are derived from the model, but anything can start an
        activity on any queue, and a job must never run on a model it did not name."""
        served = self._engine.model
        if input.spec.task is not self._task:
            raise ApplicationError(
                f"{FailureType.WRONG_MODEL}: job {input.spec.job_id} is a {input.spec.task} "
                f"job, but this worker (task queue {activity.info().task_queue}) serves "
                f"{self._task} with {served}",
                type=FailureType.WRONG_MODEL,
                non_retryable=True,
            )
        if model_identity(input.spec.model) != model_identity(served):
            raise ApplicationError(
                f"{FailureType.WRONG_MODEL}: job {input.spec.job_id} names model "
                f"{input.spec.model}, but this worker (task queue "
                f"{activity.info().task_queue}) serves {served}",
                type=FailureType.WRONG_MODEL,
                non_retryable=True,
            )


class _Queue:
    """The groups this attempt submits to the engine: those ready now, and those
    another shard leads, waited for until their result comes (shared, not submitted)
    or their lead dies (then submitted here); never waited for past the limit."""

    def __init__(self, leads: Leads, recorder: Recorder, gate: _PauseGate, drain: Drain) -> None:
        self._leads, self._recorder, self._gate = leads, recorder, gate
        self._drain = drain
        self._pending: deque[Group] = deque()
        self._waiting: list[Group] = []

    async def fill(self, groups: list[Group]) -> None:
        """Queue ``groups``: a shared one only once this attempt leads it (or another
        shard's result answered it)."""
        ready, self._waiting = await self._leads.resolve([g for g in groups if g.shared])
        self._pending.extend([g for g in groups if not g.shared] + ready)

    @property
    def left(self) -> bool:
        """Whether groups are left that this attempt did not submit (a drain stopped it)."""
        return bool(self._pending or self._waiting)

    async def requests(self) -> AsyncIterator[GenerationRequest | EmbeddingRequest]:
        # Request ids are unique per attempt, so a zombie attempt's requests in the
        # same engine never collide with the new attempt's. A draining worker submits
        # nothing more: what is left goes back.
        started_waiting = time.monotonic()
        drain = self._drain
        while (self._pending or self._waiting) and not drain.draining:
            while self._pending:
                # The gate is awaited only when it may wait or look at the ledger:
                # awaiting it under the drain's watch costs ~25 µs, per request.
                if drain.draining:
                    return
                if self._gate.may_wait() and not await unless_draining(
                    drain, self._gate.wait_while_paused()
                ):
                    return
                yield self._recorder.submit(self._pending.popleft())
            if self._waiting:
                # Other shards generate these: take their results when they come,
                # their leads when they die; never wait past the limit.
                if not await unless_draining(drain, asyncio.sleep(LEAD_POLL_SECONDS)):
                    return
                give_up = time.monotonic() - started_waiting > LEAD_WAIT_LIMIT_SECONDS
                ready, self._waiting = await self._leads.resolve(self._waiting, give_up=give_up)
                self._pending.extend(ready)
                if self._recorder.due():
                    await self._recorder.flush()


async def _give_back(
    ctx: ActivityContext,
    recorder: Recorder,
    job_id: str,
    lease: str,
    claimed: set[str],
    *,
    refund: bool = False,
) -> int | None:
    """Record the results already back, then make this attempt's unfinished items
    pending again, so none is left ``running`` with nobody working on it (``refund``:
    their claim not counted as an attempt); return how many went back, None when the
    release failed."""
    try:
        await recorder.flush()
    except Exception as exc:  # a superseded attempt: its results are not ours to keep
        log.warning("attempt %s: results not kept on cancel: %s", lease, exc)
    try:
        released = await ledger.items.release_items(
            ctx.pool, job_id=job_id, lease_owner=lease, item_ids=list(claimed), refund=refund
        )
    except Exception as exc:  # the next attempt's claim takes them over anyway
        log.warning("attempt %s: items not released on cancel: %s", lease, exc)
        return None
    log.info("attempt %s cancelled: %d unfinished items made pending again", lease, released)
    return released


async def _refused(
    ctx: ActivityContext,
    recorder: Recorder,
    job_id: str,
    lease: str,
    claimed: set[str],
    exc: EndpointRefusedError,
) -> None:
    log.error("job %s paused: %s", job_id, exc)
    await pause_job(ctx.pool, job_id=job_id, reason=str(exc))
    await _give_back(ctx, recorder, job_id, lease, claimed)


class _PauseGate:
    """Holds back new engine requests while the job is paused.

    The flag is read from the ledger at most every PAUSE_CHECK_EVERY_SECONDS, so the
    check costs one small query every few seconds, not one per item. Requests already
    in the engine finish; heartbeats go on meanwhile (they run in their own task).
    """

    def __init__(self, ctx: ActivityContext, job_id: str) -> None:
        self._ctx, self._job_id = ctx, job_id
        self._paused = False
        self._checked_at = float("-inf")

    def _due(self) -> bool:
        return time.monotonic() - self._checked_at >= PAUSE_CHECK_EVERY_SECONDS

    async def _is_paused(self) -> bool:
        if self._due():
            self._checked_at = time.monotonic()
            was_paused = self._paused
            self._paused = await ledger.jobs.job_paused(self._ctx.pool, job_id=self._job_id)
            if self._paused != was_paused:
                log.info("job %s %s", self._job_id, "paused" if self._paused else "resumed")
        return self._paused

    def may_wait(self) -> bool:
        """Whether :meth:`wait_while_paused` would do anything: the job is paused, or
        its flag is due to be read again."""
        return self._paused or self._due()

    async def wait_while_paused(self) -> None:
        # Polled, not an event: the flag lives in the ledger, written by another process.
        paused = await self._is_paused()
        while paused:
            await asyncio.sleep(PAUSE_CHECK_EVERY_SECONDS)
            paused = await self._is_paused()


async def _heartbeat_loop(
    progress: GenerateProgress, *, renew: Callable[[], Awaitable[None]] | None = None
) -> None:
    # Heartbeats carry cancellation to us and tell Temporal we are alive even while
    # the engine is busy with long generations; ``renew`` tells other shards the same.
    every_s = heartbeat_interval()
    while True:
        activity.heartbeat(progress.model_dump())
        if renew is not None:
            await renew()
        await asyncio.sleep(every_s)
