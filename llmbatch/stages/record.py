"""Record: a generate attempt's outcomes into the ledger. Engine results are buffered
and written in batches fenced by the attempt's lease, each group's result shared with
its repeats; answers the answer stage decided (another shard's lead, the result cache)
are recorded the same way; new results are offered to the result cache, an embed
job's vectors staged in the object store, and the attempt's engine usage kept up to
date.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.trace import Span
from temporalio.exceptions import ApplicationError

from llmbatch import ledger, telemetry
from llmbatch.contract.messages import GenerateProgress, ShardInput, TokenCounts
from llmbatch.contract.names import model_identity
from llmbatch.contract.states import FailureType, ItemStatus, ResultSource
from llmbatch.dedup import result_cache
from llmbatch.engine.base import BatchEngine, EngineUsage
from llmbatch.engine.requests import (
    EmbeddingRequest,
    EmbeddingResult,
    GenerationRequest,
    GenerationResult,
)
from llmbatch.formats.records import StagedRequest
from llmbatch.formats.vectors import StagedVectors
from llmbatch.stages.answer import Answer, CacheKeys, Group
from llmbatch.stages.context import StageContext

log = logging.getLogger(__name__)

FLUSH_EVERY_ITEMS = 256


FLUSH_EVERY_SECONDS = 1.0


class Recorder:
    """Buffers engine results and writes them to the ledger in batches."""

    def __init__(
        self,
        ctx: StageContext,
        input: ShardInput,
        lease: str,
        progress: GenerateProgress,
        todo: list[StagedRequest],
        *,
        usage: EngineUsage | None = None,
        engine: BatchEngine | None = None,
        weights: str | None = None,
    ) -> None:
        """``weights``: of the engine's model (default ``engine``'s), for the result
        cache's keys; None: nothing is cached."""
        self._ctx, self._input, self._lease = ctx, input, lease
        self._progress = progress
        # What went to the engine, by request index: the group each request answers.
        self._submitted = [Group(None, [r]) for r in todo]
        self._results: list[ledger.items.ItemResult] = []
        self._dead: list[ledger.items.DeadItem] = []
        self._cache: list[result_cache.NewEntry] = []
        self._last_flush = time.monotonic()
        self.succeeded = 0
        self.dead = 0
        self.tokens = TokenCounts()
        self._metrics = telemetry.metrics()
        self._metric_attrs = telemetry.attrs(job_id=input.spec.job_id, model=input.spec.model)
        self._usage = usage
        if weights is None and engine is not None:
            weights = engine.weights
        self._keys = None if weights is None else CacheKeys.of(input.spec, ctx.settings, weights)
        self._gpus = engine.gpus if engine is not None else 1
        self._usage_recorded = (0, 0.0)

    @property
    def job_id(self) -> str:
        return self._input.spec.job_id

    def submit(self, group: Group) -> GenerationRequest:
        """The engine request for ``group``'s first item."""
        request = group.items[0]
        index = len(self._submitted)
        self._submitted.append(group)
        return GenerationRequest(
            request_id=f"{self._lease}:{index}",
            messages=request.messages,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.effective_sampling(self._input.spec),
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

    def _answered(self, result: GenerationResult | EmbeddingResult) -> Group | None:
        """The group ``result`` answers, or None when the engine refused it: then every
        item of the group is dead (the same request fails the same way for each)."""
        group = self._submitted[int(result.request_id.rsplit(":", 1)[1])]
        if result.latency_ms > 0:  # the engine ran it (not refused before submission)
            self._metrics.generation_duration.record(result.latency_ms / 1000.0, self._metric_attrs)
        if result.error_class is None:
            return group
        for request in group.items:
            self._dead.append(
                ledger.items.DeadItem(
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
        group: Group,
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
                ledger.items.ItemResult(
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
        answer: dict[str, Any] = {
            "text": result.text,
            "finish_reason": result.finish_reason,
            "parsed": result.parsed,
        }
        if result.choices is not None:
            answer["choices"] = result.choices
        stored = storable(answer)
        self._share(
            group,
            stored,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            latency_ms=result.latency_ms,
        )
        if group.key is not None and self._keys is not None:
            self._cache.append(
                result_cache.NewEntry(
                    cache_key=self._keys.key(group.key),
                    result=stored,
                    prompt_tokens=result.prompt_tokens,
                    completion_tokens=result.completion_tokens,
                    item_id=group.items[0].item_id,
                )
            )

    def share(self, answers: Iterable[Answer]) -> None:
        """Record each answer's items with the result generated elsewhere (another
        shard's lead, or the cache), as the answer stage decided."""
        results = self._results
        for answer in answers:
            for request in answer.group.items:
                results.append(
                    ledger.items.ItemResult(
                        item_id=request.item_id,
                        result=answer.result,
                        prompt_tokens=answer.prompt_tokens,
                        completion_tokens=answer.completion_tokens,
                        latency_ms=0.0,
                        result_source=answer.source,
                        shared_with=answer.shared_with,
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
            written = await ledger.items.record_results(
                pool, job_id=job_id, lease_owner=self._lease, results=results
            )
            if written < len(results):
                raise superseded(self._lease)
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
        if cache and self._keys is not None:
            # After the ledger took them: only results this attempt holds are kept.
            await result_cache.store(
                pool,
                model=model_identity(model),
                weights=self._keys.weights,
                job_id=job_id,
                entries=cache,
            )
        if dead:
            written = await ledger.items.record_dead(
                pool, job_id=job_id, lease_owner=self._lease, items=dead
            )
            if written < len(dead):
                raise superseded(self._lease)
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
        await ledger.usage.record_usage(
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


class EmbedRecorder(Recorder):
    """Buffers embedding results; vectors never go to the ledger.

    Each flush first writes the buffered vectors as one object (float32 bytes, one
    vector after another) under the job's output prefix, then records in the ledger,
    fenced as for generate, where each item's vectors are. An object whose ledger write
    lost the race (a superseded attempt) or never came (a crash) is referenced by
    nothing, and its items are embedded again by the attempt that holds them.
    """

    def __init__(
        self,
        ctx: StageContext,
        input: ShardInput,
        lease: str,
        progress: GenerateProgress,
        todo: list[StagedRequest],
        *,
        usage: EngineUsage | None = None,
        engine: BatchEngine | None = None,
    ) -> None:
        super().__init__(ctx, input, lease, progress, todo, usage=usage, engine=engine)
        self._embedded: list[tuple[Group, EmbeddingResult]] = []
        # Object names unique per attempt and flush: a retry never overwrites an object
        # that items of an earlier attempt already point to.
        self._attempt_key = hashlib.sha256(lease.encode()).hexdigest()[:16]
        self._flushes = 0

    def submit(self, group: Group) -> EmbeddingRequest:  # type: ignore[override]
        """The engine request for ``group``'s one item (embed groups are single)."""
        request = group.items[0]
        index = len(self._submitted)
        self._submitted.append(group)
        return EmbeddingRequest(
            request_id=f"{self._lease}:{index}",
            texts=request.texts or [],
            token_ids=request.token_ids,
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


def superseded(lease: str) -> ApplicationError:
    # A newer attempt holds these items: this one is a zombie and must stop writing.
    log.warning("attempt %s was superseded by a newer one; stopping", lease)
    return ApplicationError(
        f"attempt {lease} was superseded by a newer attempt",
        type=FailureType.SUPERSEDED,
        non_retryable=True,
    )


def storable(value: Any) -> Any:
    """``value`` with every NUL character replaced by U+FFFD: Postgres text and jsonb
    cannot hold NUL, and a model may emit it (random weights often do), which would
    fail the whole batch of results on every retry."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value
