"""Register: a shard's rows into the ledger, each exactly once: the requests to run
pending, those the answer stage's keys answer succeeded at once (one write an item),
the rows that can never run dead and dead-lettered; what is left to run is staged for
the generate step, which a shard answered whole skips.

An item id another shard of the job registered first is this shard's copy of it: the
copy gets an id of its own (by position) and dies. Items registered pending that
other shards lead (they registered later than the answer stage looked) are waited
for once more and answered from those leads.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from llmbatch import ledger, telemetry
from llmbatch.contract.messages import RenderResult, ShardInput
from llmbatch.contract.spec import JobSpec
from llmbatch.contract.states import ErrorClass, ItemStatus
from llmbatch.dedup import leads, result_cache, waits
from llmbatch.formats.records import StagedRequest, StagedRow, dump_jsonl
from llmbatch.ledger.items import Answered, Answering, DeadItem, NewItem
from llmbatch.stages.answer import NO_KEYS, Answers
from llmbatch.stages.context import PrepareContext, Step


async def register_shard(
    ctx: PrepareContext,
    input: ShardInput,
    rows: list[StagedRow],
    requests: dict[str, StagedRequest],
    dead: list[DeadItem],
    answers: Answers,
    *,
    step: Step,
) -> RenderResult:
    """Register the shard's ``rows`` (rendered into ``requests`` and ``dead``) as
    ``answers`` has them; stage what is left to run, and say how much that is."""
    layout, spec, shard = input.layout, input.spec, input.shard

    async def register(items: list[NewItem]) -> ledger.items.Registered:
        return await ledger.items.register_items(
            ctx.pool,
            job_id=spec.job_id,
            shard=shard,
            items=items,
            answering=_answering(answers, items),
        )

    items = _new_items(rows, requests)
    registered = await register(items)
    if registered.elsewhere:
        # Another shard has these ids: the copies here get ids of their own (by
        # position) and die, so every row is accounted for exactly once.
        rows, repeated = _rename_repeated(rows, registered.elsewhere)
        requests, dead = dict(requests), [*dead]
        for row in repeated:
            requests.pop(row.fields_id, None)
            dead.append(
                DeadItem(
                    item_id=row.item_id,
                    shard=shard,
                    error_class=ErrorClass.INVALID_ITEM_ID,
                    error_message=f"item id {row.fields_id!r} repeats a row of another shard",
                    source=row.source,
                )
            )
        items = _new_items(rows, requests)
        registered = await register(items)
    done = registered.done
    if registered.answered:
        await _count_answered(ctx, spec, registered.answered, answers, items, done)
    todo_dead = [d for d in dead if d.item_id not in done]
    if todo_dead:
        marked = await ledger.items.record_dead(
            ctx.pool, job_id=spec.job_id, lease_owner=None, items=todo_dead
        )
        telemetry.metrics().count_items(
            marked, job_id=spec.job_id, model=spec.model, status=ItemStatus.DEAD
        )
    todo = [r for r in requests.values() if r.item_id not in done]
    if todo and answers.leads and not answers.waited:
        # Other shards may have registered (and led) these requests after the answer
        # stage looked: looked for again, now that they are registered.
        pending = [i.item_id for i in items if i.item_id not in done and i.item_id in requests]
        if await waits.wait_for_leads_of(
            ctx.pool,
            ctx.lead_waits,
            job_id=spec.job_id,
            shard=shard,
            lead_keys=answers.lead_keys(pending),
            heartbeat_timeout_s=step.heartbeat_timeout_s,
            beat=step.beat,
        ):
            keys = answers.keys
            answered, counts = await leads.answer_from_leads(
                ctx.pool,
                job_id=spec.job_id,
                shard=shard,
                items=[(i, lead) for i in pending if (lead := keys.get(i, NO_KEYS)[0]) is not None],
            )
            await _count_answered(ctx, spec, [counts], answers, items, answered)
            done = done | answered
            todo = [r for r in todo if r.item_id not in answered]
    if todo:
        # Only a shard with requests to run has a generate step to read them.
        await ctx.write(layout.shard_requests(shard), dump_jsonl(todo))
    telemetry.annotate(
        job_id=spec.job_id, shard=shard, rows=len(rows), requests=len(todo), dead=len(todo_dead)
    )
    return RenderResult(to_generate=len(todo), already_done=len(done), dead=len(todo_dead))


def _new_items(rows: list[StagedRow], requests: dict[str, StagedRequest]) -> list[NewItem]:
    """The ledger's rows of ``rows``: a row's prompt hash is its request's key."""
    items = []
    for row in rows:
        request = requests.get(row.item_id)
        items.append(
            NewItem(row.item_id, row.ordinal, None if request is None else request.key, row.source)
        )
    return items


def _answering(answers: Answers, items: list[NewItem]) -> Answering | None:
    """How registering ``items`` answers them (None: it does not)."""
    if answers.how is None:
        return None
    keys = answers.keys
    return leads.register_answers(
        [keys.get(i.item_id, NO_KEYS) for i in items], anonymous=answers.how.anonymous
    )


async def _count_answered(
    ctx: PrepareContext,
    spec: JobSpec,
    answered: list[Answered],
    answers: Answers,
    items: list[NewItem],
    done: set[str],
) -> None:
    """Count what was answered: the items' metrics, and the cache entries' hits (for
    each finished item whose cache key was looked up: an item its job's own lead
    answered counts too, as the entry would have answered it)."""
    metrics = telemetry.metrics()
    for group in answered:
        metrics.count_items(
            group.items,
            job_id=spec.job_id,
            model=spec.model,
            status=ItemStatus.SUCCEEDED,
            source=group.source,
        )
        metrics.count_tokens(
            prompt=group.prompt_tokens,
            completion=group.completion_tokens,
            job_id=spec.job_id,
            model=spec.model,
            reused=True,
        )
    keys = answers.keys
    uses = Counter(
        cache_key
        for i in items
        if i.item_id in done and (cache_key := keys.get(i.item_id, NO_KEYS)[1])
    )
    await result_cache.count_hits(ctx.pool, uses=uses)


class _Repeated(StagedRow, kw_only=True):
    fields_id: str


def _rename_repeated(
    rows: list[StagedRow], elsewhere: set[str]
) -> tuple[list[StagedRow], list[_Repeated]]:
    renamed: list[StagedRow] = []
    repeated: list[_Repeated] = []
    for row in rows:
        if row.item_id in elsewhere:
            copy = _Repeated(
                **{**msgspec.structs.asdict(row), "item_id": f"{row.item_id}#row-{row.ordinal}"},
                fields_id=row.item_id,
            )
            repeated.append(copy)
            renamed.append(copy)
        else:
            renamed.append(row)
    return renamed, repeated
