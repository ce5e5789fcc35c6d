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
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.context import ActivityContext
from activities.heartbeat import heartbeat_interval
from llmbatch import ledger, result_cache, telemetry
from llmbatch.config import model_identity
from llmbatch.contract.messages import GenerateProgress, GenerateResult, ShardInput, TokenCounts
from llmbatch.contract.names import GENERATE
from llmbatch.contract.spec import JobSpec, Task
from llmbatch.contract.states import FailureType, ItemStatus, ResultSource
from llmbatch.dedup import cache_key, request_key
from llmbatch.engine import (
    EmbeddingRequest,
    EmbeddingResult,
    EngineDeadError,
    EngineUsage,
    GenerationRequest,
    GenerationResult,
)
from llmbatch.engine_interface import EndpointRefusedError, InferenceEngine
from llmbatch.records import StagedRequest, load_jsonl
from llmbatch.remote.pause import pause_job
from llmbatch.vectors import StagedVectors

log = logging.getLogger(__name__)

FLUSH_EVERY_ITEMS = 256
FLUSH_EVERY_SECONDS = 1.0
# How often a running attempt reads its job's paused flag from the ledger.
PAUSE_CHECK_EVERY_SECONDS = 2.0
# How often a shard waiting for another shard's result of the same request looks.
LEAD_POLL_SECONDS = 0.5
# A lead not renewed for this many heartbeat timeouts is taken over (its attempt is
# gone without its items being claimed again, e.g. no worker took the retry yet).
LEAD_STALE_TIMEOUTS = 2.0
# Nobody waits longer than this for another shard's result: then it generates its own.
LEAD_WAIT_LIMIT_SECONDS = 600.0


class GenerateActivities:
    def __init__(
        self,
        ctx: ActivityContext,
        engine: InferenceEngine,
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
        usage = EngineUsage()
        embed = self._task is Task.EMBED
        recorder = (_EmbedRecorder if embed else _Recorder)(
            self._ctx,
            input,
            lease,
            progress,
            [],
            usage=usage,
            engine=self._engine,
        )
        gate = _PauseGate(self._ctx, job_id)
        leads = _Leads(self._ctx, job_id, lease, recorder)
        pending: deque[_Group] = deque()
        waiting: list[_Group] = []

        async def share_or_lead() -> None:
            # Identical requests of the shard in one group; then what the cache has, then
            # what another shard generated or leads; the rest this attempt generates.
            nonlocal waiting
            groups = _groups(spec, todo, dedup=spec.dedup)
            weights = self._engine.weights
            if (
                not embed
                and weights is not None
                and (spec.cache if spec.cache is not None else self._ctx.settings.cache)
            ):
                groups = await _from_cache(self._ctx, recorder, groups, weights)
            ready, waiting = await leads.resolve([g for g in groups if g.shared])
            pending.extend([g for g in groups if not g.shared] + ready)

        async def engine_requests() -> AsyncIterator[GenerationRequest | EmbeddingRequest]:
            # Request ids are unique per attempt, so a zombie attempt's requests in the
            # same engine never collide with the new attempt's.
            nonlocal waiting
            started_waiting = time.monotonic()
            while pending or waiting:
                while pending:
                    await gate.wait_while_paused()
                    yield recorder.submit(pending.popleft())
                if waiting:
                    # Other shards generate these: take their results when they come,
                    # their leads when they die; never wait past the limit.
                    await asyncio.sleep(LEAD_POLL_SECONDS)
                    give_up = time.monotonic() - started_waiting > LEAD_WAIT_LIMIT_SECONDS
                    ready, waiting = await leads.resolve(waiting, give_up=give_up)
                    pending.extend(ready)
                    if recorder.due():
                        await recorder.flush()

        heartbeat = asyncio.create_task(_heartbeat_loop(progress, renew=leads.renew))
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
            await share_or_lead()
            # One loop for both tasks: the engine call differs, nothing else.
            run_many: Any = self._engine.embed_many if embed else self._engine.generate_many
            results = run_many(engine_requests(), max_in_flight=self._max_in_flight, usage=usage)
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
        except EndpointRefusedError as exc:
            # Every item would fail the same way (a wrong key, a model the endpoint
            # does not serve): pause the job, give its items back, and let Temporal
            # retry this attempt, which waits while the job is paused.
            await asyncio.shield(_refused(self._ctx, recorder, job_id, lease, claimed, exc))
            raise ApplicationError(
                f"{exc}; job {job_id} paused", type=FailureType.ENDPOINT_REFUSED
            ) from None
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


async def _refused(
    ctx: ActivityContext,
    recorder: _Recorder,
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


@dataclass(slots=True)
class _Group:
    """Claimed items with one request: the first generates (or looks up) the result,
    the others share it. ``key`` is the request key of a reproducible request (None:
    sampled, every item on its own); ``shared`` groups coordinate with other shards."""

    key: str | None
    items: list[StagedRequest]
    shared: bool = False


def _groups(spec: JobSpec, todo: list[StagedRequest], *, dedup: bool) -> list[_Group]:
    """``todo`` by request: identical reproducible requests in one group when ``dedup``,
    every other item in a group of its own."""
    groups: list[_Group] = []
    by_key: dict[str, _Group] = {}
    for request in todo:
        sampling = request.sampling or spec.sampling
        if spec.task is Task.EMBED:
            # An embedding is a function of its texts and options: always reproducible.
            key: str | None = request_key(
                model=spec.model,
                messages=None,
                sampling=spec.sampling,
                texts=request.texts or [],
                embedding=request.embedding or spec.embed_options,
            )
        elif sampling.reproducible:
            key = request_key(
                model=spec.model,
                messages=request.messages,
                prompt=request.prompt,
                sampling=sampling,
            )
        else:
            key = None
        if key is None or not dedup:
            groups.append(_Group(key, [request]))
            continue
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = _Group(key, [request], shared=True)
            groups.append(group)
        else:
            group.items.append(request)
    return groups


async def _from_cache(
    ctx: ActivityContext, recorder: _Recorder, groups: list[_Group], weights: str
) -> list[_Group]:
    """Answer the groups the result cache holds; return the others."""
    keyed: dict[str, list[_Group]] = {}
    for group in groups:
        if group.key is not None:
            keyed.setdefault(cache_key(group.key, weights), []).append(group)
    hits = await result_cache.lookup(
        ctx.pool,
        cache_keys=list(keyed),
        uses=[sum(len(g.items) for g in gs) for gs in keyed.values()],
    )
    job_id = recorder.job_id
    rest: list[_Group] = []
    for group in groups:
        hit = hits.get(cache_key(group.key, weights)) if group.key is not None else None
        if hit is None:
            rest.append(group)
        elif hit.job_id == job_id:  # this job's own result: deduplicated, not cached
            recorder.share(group, hit, source=ResultSource.DEDUPLICATED, shared_with=hit.item_id)
        else:
            recorder.share(
                group, hit, source=ResultSource.CACHED, shared_with=f"{hit.job_id}/{hit.item_id}"
            )
    return rest


class _Leads:
    """The shard's side of in-job deduplication across shards.

    For each distinct request one item of the job leads (``dedup_leads``): its shard
    generates, the others wait and share the result. A lead lives as long as its item
    runs under the leader's lease and the leader renews it with its heartbeats, so
    when the leader's attempt dies the lead is taken over instead of waited for.
    """

    def __init__(self, ctx: ActivityContext, job_id: str, lease: str, recorder: _Recorder) -> None:
        self._ctx, self._job_id, self._lease, self._recorder = ctx, job_id, lease, recorder
        timeout = activity.info().heartbeat_timeout
        self._stale_after_s = (timeout.total_seconds() if timeout else 30.0) * LEAD_STALE_TIMEOUTS
        self._leading = False

    async def resolve(
        self, groups: list[_Group], *, give_up: bool = False
    ) -> tuple[list[_Group], list[_Group]]:
        """Share the results other shards have for ``groups``, lead what nobody (alive)
        leads; return the groups to generate and those still waiting. With
        ``give_up``, waiting groups are generated too."""
        if not groups:
            return [], []
        pool = self._ctx.pool
        current = await ledger.leads(
            pool, job_id=self._job_id, request_keys=[g.key for g in groups if g.key]
        )
        open_: list[_Group] = []
        for group in groups:
            lead = current.get(group.key or "")
            if lead is not None and lead.result is not None:
                self._recorder.share(
                    group, lead, source=ResultSource.DEDUPLICATED, shared_with=lead.item_id
                )
            else:
                open_.append(group)
        taken = await ledger.take_leads(
            pool,
            job_id=self._job_id,
            leads=[(g.key or "", g.items[0].item_id) for g in open_],
            lease_owner=self._lease,
            stale_after_s=self._stale_after_s,
        )
        self._leading = self._leading or bool(taken)
        ready = [g for g in open_ if g.key in taken]
        waiting = [g for g in open_ if g.key not in taken]
        if give_up and waiting:
            log.warning(
                "attempt %s: %d requests waited %.0f s for another shard; generating them here",
                self._lease,
                len(waiting),
                LEAD_WAIT_LIMIT_SECONDS,
            )
            ready, waiting = ready + waiting, []
        return ready, waiting

    async def renew(self) -> None:
        """Keep this attempt's leads alive (from the heartbeat loop, which must not die)."""
        if not self._leading:
            return
        try:
            await ledger.renew_leads(self._ctx.pool, job_id=self._job_id, lease_owner=self._lease)
        except Exception as exc:  # the ledger is away: others may take over, nothing lost
            log.warning("attempt %s: leads not renewed: %s", self._lease, exc)


class _Recorder:
    """Buffers engine results and writes them to the ledger in batches."""

    def __init__(
        self,
        ctx: ActivityContext,
        input: ShardInput,
        lease: str,
        progress: GenerateProgress,
        todo: list[StagedRequest],
        *,
        usage: EngineUsage | None = None,
        engine: InferenceEngine | None = None,
    ) -> None:
        self._ctx, self._input, self._lease = ctx, input, lease
        self._progress = progress
        # What went to the engine, by request index: the group each request answers.
        self._submitted = [_Group(None, [r]) for r in todo]
        self._results: list[ledger.ItemResult] = []
        self._dead: list[ledger.DeadItem] = []
        self._cache: list[result_cache.NewEntry] = []
        self._last_flush = time.monotonic()
        self.succeeded = 0
        self.dead = 0
        self.tokens = TokenCounts()
        self._metrics = telemetry.metrics()
        self._metric_attrs = telemetry.attrs(job_id=input.spec.job_id, model=input.spec.model)
        self._usage = usage
        self._weights = engine.weights if engine is not None else None
        self._gpus = engine.gpus if engine is not None else 1
        self._usage_recorded = (0, 0.0)

    @property
    def job_id(self) -> str:
        return self._input.spec.job_id

    def submit(self, group: _Group) -> GenerationRequest:
        """The engine request for ``group``'s first item."""
        request = group.items[0]
        index = len(self._submitted)
        self._submitted.append(group)
        return GenerationRequest(
            request_id=f"{self._lease}:{index}",
            messages=request.messages,
            prompt=request.prompt,
            sampling=request.sampling or self._input.spec.sampling,
        )

    def end_span(self, span: Span) -> None:
        """End the engine span with what this attempt recorded in the ledger."""
        span.set_attributes(
            telemetry.attrs(
                succeeded=self.succeeded,
                dead=self.dead,
                prompt_tokens=self.tokens.prompt,
                completion_tokens=self.tokens.completion,
                engine_requests=self._usage.requests if self._usage else None,
            )
        )
        span.end()

    def _answered(self, result: GenerationResult | EmbeddingResult) -> _Group | None:
        """The group ``result`` answers, or None when the engine refused it: then every
        item of the group is dead (the same request fails the same way for each)."""
        group = self._submitted[int(result.request_id.rsplit(":", 1)[1])]
        if result.latency_ms > 0:  # the engine ran it (not refused before submission)
            self._metrics.generation_duration.record(result.latency_ms / 1000.0, self._metric_attrs)
        if result.error_class is None:
            return group
        for request in group.items:
            self._dead.append(
                ledger.DeadItem(
                    item_id=request.item_id,
                    shard=self._input.shard,
                    error_class=result.error_class,
                    error_message=result.error_message or "",
                    source=request.source,
                )
            )
        return None

    def _share(
        self,
        group: _Group,
        result: dict[str, Any],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ms: float,
    ) -> None:
        """Record one engine result for every item of ``group``: the first generated
        it, the repeats share it (and took no engine time of their own)."""
        first = group.items[0].item_id
        for n, request in enumerate(group.items):
            self._results.append(
                ledger.ItemResult(
                    item_id=request.item_id,
                    result=result,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    latency_ms=latency_ms if n == 0 else 0.0,
                    result_source=ResultSource.GENERATED if n == 0 else ResultSource.DEDUPLICATED,
                    shared_with=None if n == 0 else first,
                )
            )

    def add(self, result: GenerationResult) -> None:
        group = self._answered(result)
        if group is None:
            return
        stored = _storable(
            {"text": result.text, "finish_reason": result.finish_reason, "parsed": result.parsed}
        )
        self._share(
            group,
            stored,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            latency_ms=result.latency_ms,
        )
        if group.key is not None and self._weights is not None:
            self._cache.append(
                result_cache.NewEntry(
                    cache_key=cache_key(group.key, self._weights),
                    result=stored,
                    prompt_tokens=result.prompt_tokens,
                    completion_tokens=result.completion_tokens,
                    item_id=group.items[0].item_id,
                )
            )

    def share(self, group: _Group, shared: Any, *, source: ResultSource, shared_with: str) -> None:
        """Record ``group``'s items with a result generated elsewhere (another shard's
        lead, or the cache): ``shared`` has ``result`` and token counts."""
        for request in group.items:
            self._results.append(
                ledger.ItemResult(
                    item_id=request.item_id,
                    result=shared.result,
                    prompt_tokens=shared.prompt_tokens or 0,
                    completion_tokens=shared.completion_tokens or 0,
                    latency_ms=0.0,
                    result_source=source,
                    shared_with=shared_with,
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
        cache, self._cache = self._cache, []
        self._last_flush = time.monotonic()
        job_id, pool = self._input.spec.job_id, self._ctx.pool
        model = self._input.spec.model
        # The engine's work first: it was done whether or not the results are kept.
        await self._record_usage()
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
            for source in ResultSource:
                mine = [r for r in results if r.result_source is source]
                self._metrics.count_items(
                    len(mine),
                    job_id=job_id,
                    model=model,
                    status=ItemStatus.SUCCEEDED,
                    source=source,
                )
                self._metrics.count_tokens(
                    prompt=sum(r.prompt_tokens for r in mine),
                    completion=sum(r.completion_tokens for r in mine),
                    job_id=job_id,
                    model=model,
                    reused=source is not ResultSource.GENERATED,
                )
        if cache and self._weights is not None:
            # After the ledger took them: only results this attempt holds are kept.
            await result_cache.store(
                pool,
                model=model_identity(model),
                weights=self._weights,
                job_id=job_id,
                entries=cache,
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

    async def _record_usage(self) -> None:
        if self._usage is None:
            return
        requests, busy_s = self._usage.requests, self._usage.busy_s
        if (requests, busy_s) == self._usage_recorded:
            return
        await ledger.record_usage(
            self._ctx.pool,
            job_id=self.job_id,
            shard=self._input.shard,
            lease_owner=self._lease,
            requests=requests,
            busy_s=busy_s,
            gpus=self._gpus,
            gpu_hour_price=self._ctx.settings.gpu_hour_price,
        )
        self._metrics.gpu_seconds.add(
            (busy_s - self._usage_recorded[1]) * self._gpus, self._metric_attrs
        )
        self._usage_recorded = (requests, busy_s)


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
        *,
        usage: EngineUsage | None = None,
        engine: InferenceEngine | None = None,
    ) -> None:
        super().__init__(ctx, input, lease, progress, todo, usage=usage, engine=engine)
        self._embedded: list[tuple[_Group, EmbeddingResult]] = []
        # Object names unique per attempt and flush: a retry never overwrites an object
        # that items of an earlier attempt already point to.
        self._attempt_key = hashlib.sha256(lease.encode()).hexdigest()[:16]
        self._flushes = 0

    def submit(self, group: _Group) -> EmbeddingRequest:  # type: ignore[override]
        """The engine request for ``group``'s one item (embed groups are single)."""
        request = group.items[0]
        index = len(self._submitted)
        self._submitted.append(group)
        return EmbeddingRequest(
            request_id=f"{self._lease}:{index}",
            texts=request.texts or [],
            options=request.embedding or self._input.spec.embed_options,
        )

    def add(self, result: GenerationResult | EmbeddingResult) -> None:
        group = self._answered(result)
        if group is None:
            return
        assert isinstance(result, EmbeddingResult)
        self._embedded.append((group, result))

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
            for group, result in embedded:
                size = sum(len(v) for v in result.vectors)
                where = StagedVectors(
                    vectors=uri,
                    offset=offset,
                    count=len(result.vectors),
                    dimensions=result.dimensions,
                ).model_dump()
                # Repeats of one request point at the same vectors: staged once.
                self._share(
                    group,
                    where,
                    prompt_tokens=result.prompt_tokens,
                    completion_tokens=0,
                    latency_ms=result.latency_ms,
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
