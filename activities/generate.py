"""generate: run a shard's requests through the worker's vLLM engine.

Runs on the GPU queue. Results go to the ledger in batches, fenced by this
attempt's lease, so a retried attempt picks up exactly what is not done yet and a
stale attempt (one that outlived its heartbeat timeout) cannot overwrite it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry.trace import Span
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.context import ActivityContext
from activities.heartbeat import heartbeat_interval
from llmbatch import ledger, telemetry
from llmbatch.config import model_identity
from llmbatch.contract.messages import GenerateProgress, GenerateResult, ShardInput, TokenCounts
from llmbatch.contract.names import GENERATE
from llmbatch.contract.spec import Task
from llmbatch.contract.states import FailureType, ItemStatus
from llmbatch.engine import (
    EmbeddingRequest,
    EmbeddingResult,
    Engine,
    EngineDeadError,
    GenerationRequest,
    GenerationResult,
)
from llmbatch.records import StagedRequest, load_jsonl

log = logging.getLogger(__name__)

FLUSH_EVERY_ITEMS = 256
FLUSH_EVERY_SECONDS = 1.0
# How often a running attempt reads its job's paused flag from the ledger.
PAUSE_CHECK_EVERY_SECONDS = 2.0


class GenerateActivities:
    def __init__(
        self,
        ctx: ActivityContext,
        engine: Engine,
        *,
        max_in_flight: int,
        on_engine_dead: Callable[[BaseException], None] | None = None,
        task: Task = Task.GENERATE,
    ) -> None:
        self._ctx = ctx
        self._engine = engine
        self._max_in_flight = max_in_flight
        self._on_engine_dead = on_engine_dead
        # The task the engine was built for: an embed worker's engine is vLLM's pooling
        # runner, and the same activity loop drives it (see _EmbedRecorder).
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
        job_id, spec = input.spec.job_id, input.spec
        self._check_model(input)
        with telemetry.span(
            "generate.read_requests", job_id=job_id, model=spec.model, shard=input.shard
        ) as read_span:
            staged = await self._ctx.read(input.layout.shard_requests(input.shard))
            requests = {r.item_id: r for r in load_jsonl(staged, StagedRequest)}
            read_span.set_attributes(telemetry.attrs(bytes=len(staged), rows=len(requests)))
        # Fenced by attempt: a stale attempt that starts late takes nothing from a newer one.
        claimed = await ledger.claim_items(
            self._ctx.pool,
            job_id=job_id,
            item_ids=list(requests),
            lease_owner=lease,
            activity=holder,
            attempt=info.attempt,
        )
        todo = [r for r in requests.values() if r.item_id in claimed]
        embed = self._task is Task.EMBED
        recorder = (_EmbedRecorder if embed else _Recorder)(self._ctx, input, lease, progress, todo)
        gate = _PauseGate(self._ctx, job_id)

        async def engine_requests() -> AsyncIterator[GenerationRequest | EmbeddingRequest]:
            # Request ids are unique per attempt, so a zombie attempt's requests in the
            # same engine never collide with the new attempt's.
            for index, r in enumerate(todo):
                await gate.wait_while_paused()
                if embed:
                    yield EmbeddingRequest(
                        request_id=f"{lease}:{index}",
                        texts=r.texts or [],
                        options=r.embedding or spec.embed_options,
                    )
                else:
                    yield GenerationRequest(
                        request_id=f"{lease}:{index}",
                        messages=r.messages,
                        prompt=r.prompt,
                        sampling=r.sampling or spec.sampling,
                    )

        heartbeat = asyncio.create_task(_heartbeat_loop(progress))
        # One span for the shard's engine work, not one per request: a job of millions
        # of rows would flood the exporter. Per-request latency goes to a histogram.
        engine_span = telemetry.tracer().start_span(
            "generate.engine",
            attributes=telemetry.attrs(
                job_id=job_id,
                model=spec.model,
                shard=input.shard,
                requests=len(todo),
                max_in_flight=self._max_in_flight,
            ),
        )
        try:
            run_many: Any = self._engine.embed_many if embed else self._engine.generate_many
            results = run_many(engine_requests(), max_in_flight=self._max_in_flight)
            async with contextlib.aclosing(results):
                async for result in results:
                    recorder.add(result)
                    if recorder.due():
                        await recorder.flush()
            await recorder.flush()
        except asyncio.CancelledError:
            # The job was cancelled. Closing generate_many has aborted the engine
            # requests by now; keep what came back, give back the rest.
            await asyncio.shield(_give_back(self._ctx, recorder, job_id, lease, claimed))
            raise
        except EngineDeadError as exc:
            if self._on_engine_dead is not None:
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

    def _check_model(self, input: ShardInput) -> None:
        """Refuse a shard for another model than the one loaded, before touching any
        item: queue names are derived from the model, but anything can start an
        activity on any queue, and a job must never run on a model it did not name."""
        served = self._engine.options.model
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


async def _give_back(
    ctx: ActivityContext, recorder: _Recorder, job_id: str, lease: str, claimed: set[str]
) -> None:
    """Record the results already back, then make this attempt's unfinished items
    pending again, so none is left ``running`` with nobody working on it."""
    try:
        await recorder.flush()
    except Exception as exc:  # a superseded attempt: its results are not ours to keep
        log.warning("attempt %s: results not kept on cancel: %s", lease, exc)
    try:
        released = await ledger.release_items(
            ctx.pool, job_id=job_id, lease_owner=lease, item_ids=list(claimed)
        )
    except Exception as exc:  # the next attempt's claim takes them over anyway
        log.warning("attempt %s: items not released on cancel: %s", lease, exc)
        return
    log.info("attempt %s cancelled: %d unfinished items made pending again", lease, released)


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

    async def _is_paused(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at >= PAUSE_CHECK_EVERY_SECONDS:
            self._checked_at = now
            was_paused = self._paused
            self._paused = await ledger.job_paused(self._ctx.pool, job_id=self._job_id)
            if self._paused != was_paused:
                log.info("job %s %s", self._job_id, "paused" if self._paused else "resumed")
        return self._paused

    async def wait_while_paused(self) -> None:
        # Polled, not an event: the flag lives in the ledger, written by another process.
        paused = await self._is_paused()
        while paused:
            await asyncio.sleep(PAUSE_CHECK_EVERY_SECONDS)
            paused = await self._is_paused()


async def _heartbeat_loop(progress: GenerateProgress) -> None:
    # Heartbeats carry cancellation to us and tell Temporal we are alive even while
    # the engine is busy with long generations.
    every_s = heartbeat_interval()
    while True:
        activity.heartbeat(progress.model_dump())
        await asyncio.sleep(every_s)


class _Recorder:
    """Buffers engine results and writes them to the ledger in batches."""

    def __init__(
        self,
        ctx: ActivityContext,
        input: ShardInput,
        lease: str,
        progress: GenerateProgress,
        todo: list[StagedRequest],
    ) -> None:
        self._ctx, self._input, self._lease = ctx, input, lease
        self._progress, self._todo = progress, todo
        self._results: list[ledger.ItemResult] = []
        self._dead: list[ledger.DeadItem] = []
        self._last_flush = time.monotonic()
        self.succeeded = 0
        self.dead = 0
        self.tokens = TokenCounts()
        self._metrics = telemetry.metrics()
        self._metric_attrs = telemetry.attrs(job_id=input.spec.job_id, model=input.spec.model)

    def end_span(self, span: Span) -> None:
        """End the engine span with what this attempt recorded in the ledger."""
        span.set_attributes(
            telemetry.attrs(
                succeeded=self.succeeded,
                dead=self.dead,
                prompt_tokens=self.tokens.prompt,
                completion_tokens=self.tokens.completion,
            )
        )
        span.end()

    def add(self, result: GenerationResult | EmbeddingResult) -> None:
        request = self._todo[int(result.request_id.rsplit(":", 1)[1])]
        if result.latency_ms > 0:  # the engine ran it (not refused before submission)
            self._metrics.generation_duration.record(result.latency_ms / 1000.0, self._metric_attrs)
        if result.error_class is not None:
            self._dead.append(
                ledger.DeadItem(
                    item_id=request.item_id,
                    shard=self._input.shard,
                    error_class=result.error_class,
                    error_message=result.error_message or "",
                    source=request.source,
                )
            )
            return
        self._keep(request.item_id, result)

    def _keep(self, item_id: str, result: Any) -> None:
        """Buffer a succeeded result for the next flush."""
        self._results.append(
            ledger.ItemResult(
                item_id=item_id,
                result=_storable(
                    {
                        "text": result.text,
                        "finish_reason": result.finish_reason,
                        "parsed": result.parsed,
                    }
                ),
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                latency_ms=result.latency_ms,
            )
        )

    def _pending(self) -> int:
        return len(self._results) + len(self._dead)

    def due(self) -> bool:
        pending = self._pending()
        return pending >= FLUSH_EVERY_ITEMS or (
            pending > 0 and time.monotonic() - self._last_flush >= FLUSH_EVERY_SECONDS
        )

    async def flush(self) -> None:
        results, self._results = self._results, []
        dead, self._dead = self._dead, []
        self._last_flush = time.monotonic()
        job_id, pool = self._input.spec.job_id, self._ctx.pool
        model = self._input.spec.model
        if results:
            written = await ledger.record_results(
                pool, job_id=job_id, lease_owner=self._lease, results=results
            )
            if written < len(results):
                raise _superseded(self._lease)
            self.succeeded += written
            tokens = TokenCounts(
                prompt=sum(r.prompt_tokens for r in results),
                completion=sum(r.completion_tokens for r in results),
            )
            self.tokens = self.tokens + tokens
            self._metrics.count_items(
                written, job_id=job_id, model=model, status=ItemStatus.SUCCEEDED
            )
            self._metrics.count_tokens(
                prompt=tokens.prompt, completion=tokens.completion, job_id=job_id, model=model
            )
        if dead:
            written = await ledger.record_dead(
                pool, job_id=job_id, lease_owner=self._lease, items=dead
            )
            if written < len(dead):
                raise _superseded(self._lease)
            self.dead += written
            self._metrics.count_items(written, job_id=job_id, model=model, status=ItemStatus.DEAD)
        self._progress.recorded = self.succeeded
        self._progress.dead = self.dead


class _EmbedRecorder(_Recorder):
    """Buffers embedding results; vectors never go to the ledger.

    Each flush first writes the buffered vectors as one object (float32 bytes, one
    vector after another) under the job's output prefix, then records in the ledger,
    fenced as for generate, where each item's vectors are. An object whose ledger write
    lost the race (a superseded attempt) or never came (a crash) is referenced by
    nothing, and its items are embedded again by the attempt that holds them.
    """

    def __init__(
        self,
        ctx: ActivityContext,
        input: ShardInput,
        lease: str,
        progress: GenerateProgress,
        todo: list[StagedRequest],
    ) -> None:
        super().__init__(ctx, input, lease, progress, todo)
        self._embedded: list[tuple[str, EmbeddingResult]] = []
        # Object names unique per attempt and flush: a retry never overwrites an object
        # that items of an earlier attempt already point to.
        self._attempt_key = hashlib.sha256(lease.encode()).hexdigest()[:16]
        self._flushes = 0

    def _keep(self, item_id: str, result: Any) -> None:
        self._embedded.append((item_id, result))

    def _pending(self) -> int:
        return len(self._embedded) + len(self._dead)

    async def flush(self) -> None:
        embedded, self._embedded = self._embedded, []
        if embedded:
            uri = self._input.layout.vectors(
                self._input.shard, f"{self._attempt_key}-{self._flushes:05d}"
            )
            self._flushes += 1
            offset = 0
            for item_id, result in embedded:
                size = sum(len(v) for v in result.vectors)
                self._results.append(
                    ledger.ItemResult(
                        item_id=item_id,
                        result={
                            "vectors": uri,
                            "offset": offset,
                            "count": len(result.vectors),
                            "dimensions": result.dimensions,
                        },
                        prompt_tokens=result.prompt_tokens,
                        completion_tokens=0,
                        latency_ms=result.latency_ms,
                    )
                )
                offset += size
            await self._ctx.write(uri, b"".join(v for _, r in embedded for v in r.vectors))
        await super().flush()


def _superseded(lease: str) -> ApplicationError:
    # A newer attempt holds these items: this one is a zombie and must stop writing.
    log.warning("attempt %s was superseded by a newer one; stopping", lease)
    return ApplicationError(
        f"attempt {lease} was superseded by a newer attempt", type="Superseded", non_retryable=True
    )


def _storable(value: Any) -> Any:
    """``value`` with every NUL character replaced by U+FFFD: Postgres text and jsonb
    cannot hold NUL, and a model may emit it (random weights often do), which would
    fail the whole batch of results on every retry."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value
