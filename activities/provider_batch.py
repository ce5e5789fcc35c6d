"""Provider batches: a shard's requests handed to an endpoint's Batch API, on the CPU queue.

Each activity is short: ``submit`` writes, uploads and creates (or finds) the shard's
provider batch and records its ids; ``check`` reads its status once; ``collect``
records its answers in the ledger; ``give_up`` dead-letters what it left; ``cancel``
cancels it. The waiting in between is :mod:`llmbatch.workflows.provider_batch`'s timers.

Items are claimed under a lease per submission (:func:`llmbatch.provider.book.lease_of`)
and answers land only while it holds them, through the generate step's
:class:`~llmbatch.stages.record.Recorder`, so they are recorded exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable
from datetime import timedelta

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import GenerateProgress, ShardInput
from llmbatch.contract.provider import (
    PROVIDER_CANCEL,
    PROVIDER_CHECK,
    PROVIDER_COLLECT,
    PROVIDER_GIVE_UP,
    PROVIDER_RELEASE_SLOT,
    PROVIDER_SUBMIT,
    PROVIDER_TAKE_SLOT,
    TERMINAL,
    ProviderBatchRef,
    ProviderBatchState,
    ProviderGiveUp,
    ProviderSubmit,
)
from llmbatch.contract.states import BatchStatus, ErrorClass, FailureType, ItemStatus
from llmbatch.engine.requests import GenerationRequest, failed
from llmbatch.formats.records import StagedRequest, load_jsonl
from llmbatch.provider import book, slots
from llmbatch.provider.client import TOKEN_KEY, BatchClient, ProviderError
from llmbatch.provider.lines import CHAT_URL, answer_result, request_line
from llmbatch.provider.settings import batch_endpoint
from llmbatch.remote.endpoints import Endpoint, EndpointError, get_endpoint
from llmbatch.stages.answer import Group, group_requests, groups_to_run
from llmbatch.stages.context import StageContext
from llmbatch.stages.record import Recorder

log = logging.getLogger(__name__)


class ProviderRecorder(Recorder):
    """The generate step's recorder, for answers that came from a provider batch:
    the cache is keyed by the endpoint and model, as for the endpoint's online answers."""

    def __init__(
        self, ctx: StageContext, input: ShardInput, lease: str, *, endpoint: Endpoint
    ) -> None:
        # The remote engine's weights (llmbatch.remote.engine): online and batch
        # answers of one endpoint and model share the result cache.
        super().__init__(
            ctx, input, lease, GenerateProgress(), [], weights=endpoint.weights(input.spec.model)
        )


class ProviderBatchActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    async def _staged(self, input: ShardInput) -> dict[str, StagedRequest]:
        data = await self._ctx.read(input.layout.shard_requests(input.shard))
        return {r.item_id: r for r in load_jsonl(data, StagedRequest)}

    async def _endpoint(self, input: ShardInput) -> Endpoint:
        assert input.spec.remote_endpoint is not None  # JobSpec: via batch needs one
        try:
            return await get_endpoint(self._ctx.pool, input.spec.remote_endpoint)
        except EndpointError as exc:
            raise ApplicationError(str(exc), type=FailureType.ENDPOINT_REFUSED) from None

    @activity.defn(name=PROVIDER_TAKE_SLOT)
    async def take_slot(self, input: ProviderSubmit) -> bool:
        """Take one of the endpoint's ``--batch-max-in-flight`` slots for the
        submission (or find the one it holds); False: none is free now."""
        shard, spec = input.shard, input.shard.spec
        try:
            _, batch_api = await batch_endpoint(self._ctx.pool, spec.remote_endpoint or "")
        except EndpointError as exc:
            # Removed (or its Batch API) since the job started: this step, retried
            # until Postgres answers, would otherwise wait for ever.
            raise ApplicationError(
                str(exc), type=FailureType.ENDPOINT_REFUSED, non_retryable=True
            ) from None
        info = activity.info()
        take = functools.partial(
            slots.take,
            self._ctx.pool,
            token=_token(input),
            endpoint=spec.remote_endpoint or "",
            job_id=spec.job_id,
            shard=shard.shard,
            max_in_flight=batch_api.max_in_flight,
            workflow_id=info.workflow_id,
            run_id=info.workflow_run_id,
        )
        if await take():
            return True
        # None free: a holder (or an older waiter) whose workflow was terminated ran no
        # code to give its row back. Free those, then try once more.
        due = await slots.due_for_check(
            self._ctx.pool, endpoint=spec.remote_endpoint or "", token=_token(input)
        )
        closed = await closed_runs(activity.client(), due)
        if not closed:
            return False
        freed = await slots.free_closed(self._ctx.pool, closed)
        if freed:
            log.warning(
                "freed %d provider batch slot(s) of endpoint %s held by closed workflows: %s",
                len(freed),
                spec.remote_endpoint,
                ", ".join(h.workflow_id or "" for h in closed if h.token in freed),
            )
            await self._cancel_orphans(freed)
        return await take()

    async def _cancel_orphans(self, tokens: list[str]) -> None:
        """Cancel the provider batches of slots freed from closed workflows: nobody
        waits for them, so their answers would be paid for and never read.

        Never a second payment: the only run that could still want such a batch is a
        reset of its workflow, which finds it by its token (cancelled, with what it
        finished) and dead-letters the rest as BatchCancelled, for a re-drive. A cancel
        that fails (the batch finished meanwhile, the provider away) is only logged:
        the slot is free either way."""
        for token in tokens:
            row = await book.get(self._ctx.pool, token)
            if row is None or row.batch_id is None or row.status in TERMINAL:
                continue  # a waiting row, or no batch created (yet), or it has ended
            try:
                async with BatchClient(await get_endpoint(self._ctx.pool, row.endpoint)) as c:
                    batch = await c.cancel(row.batch_id)
                counts = batch.get("request_counts") or {}
                await book.set_status(
                    self._ctx.pool,
                    token=token,
                    status=BatchStatus(batch["status"]),
                    completed=int(counts.get("completed") or 0),
                    failed=int(counts.get("failed") or 0),
                )
                log.warning("provider batch %s of a closed workflow cancelled", row.batch_id)
            except (ProviderError, EndpointError, KeyError, ValueError) as exc:
                log.warning("provider batch %s not cancelled: %s", row.batch_id, exc)

    @activity.defn(name=PROVIDER_RELEASE_SLOT)
    async def release_slot(self, input: ProviderSubmit) -> None:
        """The submission's batch ended (or never started): its slot is free."""
        await slots.release(self._ctx.pool, token=_token(input))

    @activity.defn(name=PROVIDER_SUBMIT)
    async def submit(self, input: ProviderSubmit) -> ProviderBatchRef:
        """The shard's provider batch number ``submission``: created once, whatever
        fails. Its file id is recorded before the batch is created, its batch id right
        after; a retry that finds a recorded file but no batch id looks for the batch
        on the provider by its metadata token before it creates one."""
        shard, spec = input.shard, input.shard.spec
        token = _token(input)
        lease = book.lease_of(spec.job_id, shard.shard, input.submission, redrive=shard.redrive)
        pool = self._ctx.pool
        try:
            endpoint, batch_api = await batch_endpoint(pool, spec.remote_endpoint or "")
        except EndpointError as exc:
            raise ApplicationError(str(exc), type=FailureType.ENDPOINT_REFUSED) from None
        row = await book.get(pool, token)
        recorded_before = row is not None
        if row is None:
            row = await self._prepare(input, token=token, lease=lease, endpoint=endpoint)
        ref = ProviderBatchRef(
            shard=shard,
            token=token,
            submission=input.submission,
            lease_owner=lease,
            batch_id=row.batch_id,
            requests=row.requests,
        )
        if row.batch_id is not None or row.input_file_id is None:
            return ref
        async with BatchClient(endpoint) as client:
            found = await client.find(token) if recorded_before else None
            if found is None:
                found = await client.create(
                    input_file_id=row.input_file_id,
                    url=row.url or CHAT_URL,
                    window=batch_api.completion_window,
                    metadata={
                        "job": spec.job_id[:256],
                        "shard": str(shard.shard),
                        TOKEN_KEY: token,
                    },
                )
            else:
                log.info("provider batch %s of %s found on the provider", found["id"], token)
        ref.batch_id = await book.record_batch(
            pool, token=token, batch_id=str(found["id"]), status=str(found.get("status"))
        )
        return ref

    async def _prepare(
        self, input: ProviderSubmit, *, token: str, lease: str, endpoint: Endpoint
    ) -> book.ProviderBatchRow:
        """Claim the shard's unfinished items, answer what deduplication and the
        cache can, write the rest as a requests file, upload it and record it."""
        shard, spec = input.shard, input.shard.spec
        _, batch_api = await batch_endpoint(self._ctx.pool, endpoint.name)
        staged = await self._staged(shard)
        claimed = await ledger.items.claim_items(
            self._ctx.pool, job_id=spec.job_id, item_ids=list(staged), lease_owner=lease
        )
        todo = [r for r in staged.values() if r.item_id in claimed]
        recorder = ProviderRecorder(self._ctx, shard, lease, endpoint=endpoint)
        groups, answers = await groups_to_run(
            self._ctx, spec, todo, weights=endpoint.weights(spec.model)
        )
        recorder.share(answers)
        lines: list[bytes] = []
        url: str | None = None
        followers: dict[str, list[str]] = {}
        for group in groups:
            lead = group.items[0]
            made = request_line(
                lead.item_id,
                model=spec.model,
                messages=lead.messages,
                prompt=lead.prompt,
                sampling=lead.effective_sampling(spec),
            )
            if isinstance(made, tuple) and url is not None and made[0] != url:
                made = f"a provider batch takes one URL ({url}); this request is for {made[0]}"
            if isinstance(made, str):
                recorder.add(failed(recorder.submit(group), ErrorClass.INVALID_REQUEST, made))
                continue
            url = made[0]
            lines.append(made[1])
            if len(group.items) > 1:
                followers[lead.item_id] = [r.item_id for r in group.items[1:]]
        await recorder.flush()
        data = b"".join(lines)
        if len(lines) > batch_api.max_requests or len(data) > batch_api.max_bytes:
            raise ApplicationError(
                f"shard {shard.shard} has {len(lines)} requests ({len(data)} bytes), over "
                f"endpoint {endpoint.name}'s {batch_api.max_requests} requests or "
                f"{batch_api.max_bytes} bytes a batch; submit with a smaller --shard-size",
                type=FailureType.INVALID_JOB_SPEC,
                non_retryable=True,
            )
        file_id = None
        if lines:
            async with BatchClient(endpoint) as client:
                file_id = await client.upload(data, filename=f"llmbatch-{token}.jsonl")
        return await book.prepared(
            self._ctx.pool,
            token=token,
            job_id=spec.job_id,
            shard=shard.shard,
            submission=input.submission,
            endpoint=endpoint.name,
            lease_owner=lease,
            input_file_id=file_id,
            url=url,
            requests=len(lines),
            followers=followers,
        )

    @activity.defn(name=PROVIDER_CHECK)
    async def check(self, ref: ProviderBatchRef) -> ProviderBatchState:
        """The batch's status now (one request), recorded for ``status``."""
        assert ref.batch_id is not None
        async with BatchClient(await self._endpoint(ref.shard)) as client:
            batch = await client.retrieve(ref.batch_id)
        counts = batch.get("request_counts") or {}
        errors = (batch.get("errors") or {}).get("data") or []
        state = ProviderBatchState(
            status=BatchStatus(batch["status"]),
            completed=int(counts.get("completed") or 0),
            failed=int(counts.get("failed") or 0),
            total=int(counts.get("total") or 0),
            output_file_id=batch.get("output_file_id"),
            error_file_id=batch.get("error_file_id"),
            errors=[f"line {e.get('line')}: {e.get('message')}" for e in errors][:20],
        )
        await book.set_status(
            self._ctx.pool,
            token=ref.token,
            status=state.status,
            completed=state.completed,
            failed=state.failed,
        )
        return state

    async def _held(self, ref: ProviderBatchRef) -> set[str]:
        """The items the batch's lease still holds (its answers not recorded yet)."""
        rows = await self._ctx.pool.fetch(
            "SELECT item_id FROM items WHERE job_id = $1 AND shard = $2 AND lease_owner = $3 "
            "AND status = $4",
            ref.shard.spec.job_id,
            ref.shard.shard,
            ref.lease_owner,
            ItemStatus.RUNNING,
        )
        return {r["item_id"] for r in rows}

    @activity.defn(name=PROVIDER_COLLECT)
    async def collect(self, ref: ProviderBatchRef) -> int:
        """Record the batch's output and error lines in the ledger, once: only items
        the batch's lease still holds are recorded, so a retry takes what is left."""
        pool = self._ctx.pool
        row = await book.get(pool, ref.token)
        assert row is not None and ref.batch_id is not None
        if row.collected:
            return 0
        endpoint = await self._endpoint(ref.shard)
        staged = await self._staged(ref.shard)
        held = await self._held(ref)
        shared = {f for fs in row.followers.values() for f in fs}
        recorder = ProviderRecorder(self._ctx, ref.shard, ref.lease_owner, endpoint=endpoint)
        request_id_of: dict[str, str] = {}
        for lead in held - shared:
            items = [staged[lead]] + [staged[f] for f in row.followers.get(lead, []) if f in held]
            # The lead's request key, as at submission: answers go to the result cache.
            key = group_requests(ref.shard.spec, items[:1], dedup=False)[0].key
            request: GenerationRequest = recorder.submit(Group(key, items))
            request_id_of[lead] = request.request_id
        sampling_of = {i: staged[i].effective_sampling(ref.shard.spec) for i in request_id_of}
        async with BatchClient(endpoint) as client:
            batch = await client.retrieve(ref.batch_id)
            for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
                if not file_id:
                    continue
                async for line in client.lines(file_id):
                    result = answer_result(
                        line, request_id_of=request_id_of, sampling_of=sampling_of
                    )
                    if result is None:
                        continue
                    recorder.add(result)
                    if recorder.due():
                        await recorder.flush()
                        activity.heartbeat(recorder.succeeded + recorder.dead)
        await recorder.flush()
        await book.mark_collected(
            pool,
            token=ref.token,
            prompt_tokens=row.prompt_tokens + recorder.tokens.prompt,
            completion_tokens=row.completion_tokens + recorder.tokens.completion,
        )
        return recorder.succeeded + recorder.dead

    @activity.defn(name=PROVIDER_GIVE_UP)
    async def give_up(self, input: ProviderGiveUp) -> int:
        """Dead-letter what the batch's lease still holds, with the provider's reason."""
        ref = input.ref
        held = await self._held(ref)
        staged = await self._staged(ref.shard)
        return await ledger.items.record_dead(
            self._ctx.pool,
            job_id=ref.shard.spec.job_id,
            lease_owner=ref.lease_owner,
            items=list(_dead(held, staged, ref, input.error_class, input.message)),
        )

    @activity.defn(name=PROVIDER_CANCEL)
    async def cancel(self, ref: ProviderBatchRef) -> None:
        """The job was cancelled: cancel the provider batch and give its items back."""
        if ref.batch_id is not None:
            try:
                async with BatchClient(await self._endpoint(ref.shard)) as client:
                    await client.cancel(ref.batch_id)
            except ProviderError as exc:  # e.g. it finished meanwhile
                log.warning("provider batch %s not cancelled: %s", ref.batch_id, exc)
        await ledger.items.release_items(
            self._ctx.pool,
            job_id=ref.shard.spec.job_id,
            lease_owner=ref.lease_owner,
            item_ids=list(await self._held(ref)),
        )


async def closed_runs(client: Client, holders: list[slots.Holder]) -> list[slots.Holder]:
    """The holders whose workflow is closed in Temporal (or gone from it), described
    a few at a time; a describe that fails counts as running (checked again later).

    The latest run of the workflow id decides: a reset run of the same id, which holds
    the token's slot without taking it again, keeps it."""
    limit = asyncio.Semaphore(_DESCRIBES_AT_ONCE)

    async def closed(holder: slots.Holder) -> bool:
        assert holder.workflow_id is not None  # due_for_check picks only named rows
        async with limit:
            try:
                described = await client.get_workflow_handle(holder.workflow_id).describe(
                    rpc_timeout=_DESCRIBE_TIMEOUT
                )
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return True  # closed and past the namespace's retention
                log.warning("workflow %s not described: %s", holder.workflow_id, exc)
                return False
        return described.status != WorkflowExecutionStatus.RUNNING

    found = await asyncio.gather(*(closed(h) for h in holders))
    return [h for h, is_closed in zip(holders, found, strict=True) if is_closed]


# Describes of slot holders in flight at once, and how long one may take.
_DESCRIBES_AT_ONCE = 16
_DESCRIBE_TIMEOUT = timedelta(seconds=10)


def _token(input: ProviderSubmit) -> str:
    shard = input.shard
    # A re-driven shard's batches are its own: never the job's first run's.
    return book.token_of(shard.spec.job_id, shard.shard, input.submission, redrive=shard.redrive)


def _dead(
    held: Iterable[str],
    staged: dict[str, StagedRequest],
    ref: ProviderBatchRef,
    error_class: ErrorClass,
    message: str,
) -> Iterable[ledger.items.DeadItem]:
    for item_id in sorted(held):
        yield ledger.items.DeadItem(
            item_id=item_id,
            shard=ref.shard.shard,
            error_class=error_class,
            error_message=message,
            source=staged[item_id].source if item_id in staged else None,
        )
