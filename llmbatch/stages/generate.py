"""Generate: a generate attempt's engine loop over its shard's requests.

An :class:`Attempt` reads the requests registering staged, claims the unfinished ones
under its lease (fenced: a stale attempt that starts late takes nothing from a newer
one), has the answer stage group them and answer what the result cache and other
shards' leads hold, and runs the rest through the worker's engine (any
:class:`~llmbatch.engine.base.BatchEngine`), many in flight, handing each result to the
record stage as it comes. New requests are held back while the job is paused
(:class:`PauseGate`); the worker's drain (:mod:`llmbatch.stages.drain`) stops the loop,
and what the attempt did not finish goes back to the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.trace import Span

from llmbatch import ledger, telemetry
from llmbatch.contract.messages import GenerateProgress, GenerateResult, ShardInput
from llmbatch.engine.base import BatchEngine, EngineUsage
from llmbatch.engine.errors import EndpointRefusedError
from llmbatch.engine.requests import EmbeddingRequest, GenerationRequest
from llmbatch.formats.records import StagedRequest, load_jsonl
from llmbatch.remote.pause import pause_job
from llmbatch.stages.answer import LEAD_WAIT_LIMIT_SECONDS, Group, Leads, groups_to_run
from llmbatch.stages.context import StageContext, Step
from llmbatch.stages.drain import Drain, drained, finish_before_cancel, unless_draining, watch
from llmbatch.stages.record import EmbedRecorder, Recorder

log = logging.getLogger(__name__)


# How often a running attempt reads its job's paused flag from the ledger.
PAUSE_CHECK_EVERY_SECONDS = 2.0


# How often a shard waiting for another shard's result of the same request looks.
LEAD_POLL_SECONDS = 0.5


class Attempt:
    """One attempt of a shard's generate step, under the lease ``holder#attempt``
    (``holder``: the Temporal activity, ``attempt``: its attempt number)."""

    def __init__(
        self,
        ctx: StageContext,
        input: ShardInput,
        engine: BatchEngine,
        *,
        holder: str,
        attempt: int,
        progress: GenerateProgress,
        step: Step,
        drain: Drain,
        max_in_flight: int,
        embed: bool,
    ) -> None:
        self._ctx, self._input, self._engine = ctx, input, engine
        self._holder, self._attempt = holder, attempt
        self.lease = f"{holder}#{attempt}"
        self._progress, self._step, self._drain = progress, step, drain
        self._max_in_flight = max_in_flight
        # An embed worker's engine is vLLM's pooling runner; the same loop drives it.
        self._embed = embed
        self._usage = EngineUsage()
        self.recorder = (EmbedRecorder if embed else Recorder)(
            ctx, input, self.lease, progress, [], usage=self._usage, engine=engine
        )
        self.leads = Leads(
            ctx,
            input.spec.job_id,
            self.lease,
            shard=input.shard,
            heartbeat_timeout_s=step.heartbeat_timeout_s,
        )
        self._requests: dict[str, StagedRequest] = {}
        self._claimed: set[str] = set()
        self._todo: list[StagedRequest] = []
        self._span: Span | None = None

    async def claim(self) -> None:
        """Read the shard's requests and claim those the ledger has not finished."""
        self._requests = await self._read_requests()
        # Fenced by attempt: a stale attempt that starts late takes nothing from a newer one.
        self._claimed = await ledger.items.claim_items(
            self._ctx.pool,
            job_id=self._input.spec.job_id,
            item_ids=list(self._requests),
            lease_owner=self.lease,
            activity=self._holder,
            attempt=self._attempt,
        )
        self._todo = [r for r in self._requests.values() if r.item_id in self._claimed]
        self._span = self._engine_span(requests=len(self._todo))

    async def run(self) -> None:
        """Answer or generate every claimed request, recording as results come; a
        drained attempt gives back what is left and fails with :func:`drained`."""
        spec = self._input.spec
        # Identical requests of the shard in one group, then what the result cache
        # answers recorded as such; what is left goes to the queue.
        groups, answers = await groups_to_run(
            self._ctx, spec, self._todo, weights=self._engine.weights, embed=self._embed
        )
        self.recorder.share(answers)
        queue = RequestQueue(
            self.leads, self.recorder, PauseGate(self._ctx, spec.job_id), self._drain
        )
        await queue.fill(groups)
        aborted = await self._run_engine(queue.requests())
        if self._drain.draining and (queue.left or aborted):
            await self._hand_back(aborted=aborted)

    async def cancelled(self) -> None:
        """The job was cancelled. Closing generate_many has aborted the engine requests
        by now; keep what came back, give back the rest. Cancelled by the worker's own
        stop (the drain's window ran out before the hand-back was done) is the stop's
        doing, not the items': no attempt counted."""
        stopping = self._drain.draining
        released = await _give_back(
            self._ctx,
            self.recorder,
            self._input.spec.job_id,
            self.lease,
            self._claimed,
            refund=stopping,
        )
        if stopping:
            # Said as a drained attempt says it: what a stop cost must not depend on
            # whether the hand-back beat the SDK's cancel (on a starved CPU it may not).
            self._log_drained(released, aborted=self._drain.past_deadline, cut_short=True)

    async def refused(self, exc: EndpointRefusedError) -> None:
        """Every item would fail the same way (a wrong key, a model the endpoint does
        not serve): pause the job and give its items back."""
        job_id = self._input.spec.job_id
        log.error("job %s paused: %s", job_id, exc)
        await pause_job(self._ctx.pool, job_id=job_id, reason=str(exc))
        await _give_back(self._ctx, self.recorder, job_id, self.lease, self._claimed)

    def end_span(self) -> None:
        if self._span is not None:
            self.recorder.end_span(self._span)

    def result(self) -> GenerateResult:
        recorder = self.recorder
        return GenerateResult(
            generated=recorder.succeeded,
            dead=recorder.dead,
            skipped=len(self._requests) - len(self._todo),
            tokens=recorder.tokens,
        )

    async def _read_requests(self) -> dict[str, StagedRequest]:
        """The shard's rendered requests, by item id."""
        input = self._input
        spec = input.spec
        with telemetry.span(
            "generate.read_requests", job_id=spec.job_id, model=spec.model, shard=input.shard
        ) as read_span:
            staged = await self._ctx.read(input.layout.shard_requests(input.shard))
            requests = {r.item_id: r for r in load_jsonl(staged, StagedRequest)}
            read_span.set_attributes(telemetry.attrs(bytes=len(staged), rows=len(requests)))
        return requests

    def _engine_span(self, *, requests: int) -> Span:
        # One span for the shard's engine work, not one per request: a job of millions
        # of rows would flood the exporter. Per-request latency goes to a histogram.
        input = self._input
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
        self, requests: AsyncIterator[GenerationRequest | EmbeddingRequest]
    ) -> bool:
        """Every request through the engine, results recorded as they come; return
        whether a drain's deadline aborted requests still in flight."""
        recorder = self.recorder
        # One loop for both tasks: the engine call differs, nothing else.
        run_many: Any = self._engine.embed_many if self._embed else self._engine.generate_many
        results = run_many(requests, max_in_flight=self._max_in_flight, usage=self._usage)
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

    async def _hand_back(self, *, aborted: bool) -> None:
        """End a drained attempt: what it recorded stays, its unfinished items go back
        without the attempt counted against them, and the step is retried elsewhere."""
        recorder = self.recorder
        released = await ledger.items.release_items(
            self._ctx.pool,
            job_id=self._input.spec.job_id,
            lease_owner=self.lease,
            item_ids=list(self._claimed),
            refund=True,
        )
        self._step.beat()
        self._log_drained(released, aborted=aborted)
        raise drained(
            f"worker stopped; {released} unfinished items of this shard given back, "
            f"{recorder.succeeded + recorder.dead} recorded"
        )

    def _log_drained(self, released: int | None, *, aborted: bool, cut_short: bool = False) -> None:
        # A warning: it is seldom, and an operator wants to see what a stop cost.
        log.warning(
            "attempt %s drained in %.1f s: %d results recorded, %s items given back%s%s",
            self.lease,
            self._drain.seconds_since_begun(),
            self.recorder.succeeded + self.recorder.dead,
            "unknown" if released is None else released,
            " (in-flight requests aborted at the drain deadline)" if aborted else "",
            " (the worker's stop cancelled the attempt before it handed back)" if cut_short else "",
        )


class RequestQueue:
    """The groups an attempt submits to the engine: those ready now, and those
    another shard leads, waited for until their result comes (recorded, not
    submitted) or their lead dies (then submitted here); never waited for past the
    limit."""

    def __init__(self, leads: Leads, recorder: Recorder, gate: PauseGate, drain: Drain) -> None:
        self._leads, self._recorder, self._gate = leads, recorder, gate
        self._drain = drain
        self._pending: deque[Group] = deque()
        self._waiting: list[Group] = []

    async def fill(self, groups: list[Group]) -> None:
        """Queue ``groups``: a shared one only once this attempt leads it (or another
        shard's result answered it)."""
        ready, self._waiting, answers = await self._leads.resolve([g for g in groups if g.shared])
        self._recorder.share(answers)
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
                ready, self._waiting, answers = await self._leads.resolve(
                    self._waiting, give_up=give_up
                )
                self._recorder.share(answers)
                self._pending.extend(ready)
                if self._recorder.due():
                    await self._recorder.flush()


async def _give_back(
    ctx: StageContext,
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


class PauseGate:
    """Holds back new engine requests while the job is paused.

    The flag is read from the ledger at most every PAUSE_CHECK_EVERY_SECONDS, so the
    check costs one small query every few seconds, not one per item. Requests already
    in the engine finish; heartbeats go on meanwhile (they run in their own task).
    """

    def __init__(self, ctx: StageContext, job_id: str) -> None:
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
