"""Rendering a shard's rows into generation requests and registering them in the ledger
(:func:`render_and_register`, the second half of ``prepare_shard``), and the
``render_prompts`` step of shards started before that step existed.

Requests another shard of the job already answered, or the result cache holds, are
answered here, as a generate attempt would answer them
(:func:`llmbatch.dedup.coordination.render_answers`): written to the ledger once,
succeeded, and never staged for the generate step, which a shard answered whole skips.
A shard whose every request other shards lead waits for their results here first
(:func:`llmbatch.dedup.coordination.wait_for_leads`), so that it is answered whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec
from temporalio import activity

from llmbatch import ledger, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import RenderResult, ShardInput
from llmbatch.contract.names import RENDER_PROMPTS
from llmbatch.contract.spec import InputFormat, JobSpec, SamplingSpec, Task
from llmbatch.contract.states import ErrorClass, ItemStatus
from llmbatch.dedup import leads, result_cache
from llmbatch.dedup.coordination import (
    RenderAnswers,
    lead_stale_after_s,
    render_answers,
    wait_for_leads,
)
from llmbatch.dedup.keys import request_key
from llmbatch.formats import openai_requests
from llmbatch.formats.records import StagedRequest, StagedRow, dump_jsonl, load_jsonl
from llmbatch.ledger.served_models import cache_policy
from llmbatch.rendering.pool import Rendered, RenderPool
from llmbatch.rendering.templates import TemplateError


class RenderActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=RENDER_PROMPTS)
    async def render_prompts(self, input: ShardInput) -> RenderResult:
        """Render the rows ``fetch_shard`` staged: the second step of shards started
        before ``prepare_shard`` did both (workflows.shard keeps them replaying)."""
        rows = list(
            load_jsonl(await self._ctx.read(input.layout.shard_rows(input.shard)), StagedRow)
        )
        return await render_and_register(self._ctx, input, rows)


async def render_and_register(
    ctx: ActivityContext, input: ShardInput, rows: list[StagedRow]
) -> RenderResult:
    """Render every row; rows that can never run go to the dead list right here, and
    requests already answered are recorded succeeded; the rest are staged for generate."""
    layout, spec, shard = input.layout, input.spec, input.shard
    requests, dead = await render_rows(
        ctx.renders,
        spec,
        layout.input_format,
        rows,
        shard=shard,
        overrides=input.sampling_overrides,
    )
    answers = render_answers(spec, await cache_policy(ctx.pool, task_queue=input.gpu_task_queue))

    async def register(items: list[ledger.items.NewItem]) -> ledger.items.Registered:
        return await ledger.items.register_items(
            ctx.pool,
            job_id=spec.job_id,
            shard=shard,
            items=items,
            anonymous=answers is not None and answers.anonymous,
        )

    items = _new_items(spec, rows, requests, answers)
    # Requests other shards lead (from their registering on) are registered once
    # their results are in, so that registering answers them (one write an item).
    # Earlier shards of the job not registered yet are waited for first (they lead
    # what they leave pending); when another shard registered them later than this
    # one looked all the same, they are looked for again below, once registered.
    waited = (
        answers is not None
        and answers.leads
        and await _wait_for_leads(
            ctx, input, [i for i in items if i.item_id in requests], earlier_shards=True
        )
    )
    registered = await register(items)
    if registered.elsewhere:
        # Another shard has these ids: the copies here get ids of their own (by
        # position) and die, so every row is accounted for exactly once.
        rows, repeated = _rename_repeated(rows, registered.elsewhere)
        for row in repeated:
            requests.pop(row.fields_id, None)
            dead.append(
                ledger.items.DeadItem(
                    item_id=row.item_id,
                    shard=shard,
                    error_class=ErrorClass.INVALID_ITEM_ID,
                    error_message=f"item id {row.fields_id!r} repeats a row of another shard",
                    source=row.source,
                )
            )
        items = _new_items(spec, rows, requests, answers)
        registered = await register(items)
    done = registered.done
    if registered.answered:
        await _count_answered(ctx, spec, registered.answered, items, done)
    todo_dead = [d for d in dead if d.item_id not in done]
    if todo_dead:
        marked = await ledger.items.record_dead(
            ctx.pool, job_id=spec.job_id, lease_owner=None, items=todo_dead
        )
        telemetry.metrics().count_items(
            marked, job_id=spec.job_id, model=spec.model, status=ItemStatus.DEAD
        )
    todo = [r for r in requests.values() if r.item_id not in done]
    if todo and answers is not None and answers.leads and not waited:
        pending = [i for i in items if i.item_id not in done and i.item_id in requests]
        if await _wait_for_leads(ctx, input, pending):
            answered, counts = await leads.answer_from_leads(
                ctx.pool,
                job_id=spec.job_id,
                shard=shard,
                items=[(i.item_id, i.lead_key) for i in pending if i.lead_key is not None],
            )
            await _count_answered(ctx, spec, [counts], items, answered)
            done = done | answered
            todo = [r for r in todo if r.item_id not in answered]
    if todo:
        # Only a shard with requests to run has a generate step to read them.
        await ctx.write(layout.shard_requests(shard), dump_jsonl(todo))
    telemetry.annotate(
        job_id=spec.job_id, shard=shard, rows=len(rows), requests=len(todo), dead=len(todo_dead)
    )
    return RenderResult(to_generate=len(todo), already_done=len(done), dead=len(todo_dead))


async def _wait_for_leads(
    ctx: ActivityContext,
    input: ShardInput,
    items: list[ledger.items.NewItem],
    *,
    earlier_shards: bool = False,
) -> bool:
    """Wait while other shards lead every request of ``items``
    (:func:`llmbatch.dedup.coordination.wait_for_leads`, for the job's earlier shards
    to register first with ``earlier_shards``); whether they did."""
    keys = {i.lead_key for i in items}
    # A request without a lead key (sampled) runs here anyway: nothing to wait for.
    # Nor when enough steps of this worker wait already.
    if not items or None in keys or not ctx.lead_waits.take():
        return False
    try:
        heartbeat_timeout = activity.info().heartbeat_timeout
        return await wait_for_leads(
            ctx.pool,
            job_id=input.spec.job_id,
            shard=input.shard,
            request_keys=sorted(k for k in keys if k is not None),
            stale_after_s=lead_stale_after_s(
                heartbeat_timeout.total_seconds() if heartbeat_timeout else None
            ),
            beat=activity.heartbeat,
            earlier_shards=earlier_shards,
        )
    finally:
        ctx.lead_waits.give_back()


async def _count_answered(
    ctx: ActivityContext,
    spec: JobSpec,
    answered: list[ledger.items.Answered],
    items: list[ledger.items.NewItem],
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
    uses = Counter(i.cache_key for i in items if i.cache_key and i.item_id in done)
    await result_cache.count_hits(ctx.pool, uses=uses)


async def render_rows(
    renders: RenderPool,
    spec: JobSpec,
    fmt: InputFormat,
    rows: list[StagedRow],
    *,
    shard: int,
    overrides: dict[str, Any],
) -> tuple[dict[str, StagedRequest], list[ledger.items.DeadItem]]:
    """Staged requests and dead items for a shard's ``rows``, as ``prepare_shard``
    makes them (and ``submit --estimate`` counts them)."""
    # Templates render in child processes (llmbatch.rendering.pool): a runaway one
    # costs its rows their time limit, never this worker's event loop.
    templated = _templated(rows, fmt)
    # An embed job's text template renders as one message, in the same sandbox.
    templates = spec.template_messages()
    outcomes = (
        await renders.render(templates, [rows[i].fields or {} for i in templated])
        if templated and templates
        else []
    )
    return _render(
        spec,
        fmt,
        rows,
        shard=shard,
        overrides=overrides,
        rendered=dict(zip(templated, outcomes, strict=True)),
    )


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


def _new_items(
    spec: JobSpec,
    rows: list[StagedRow],
    requests: dict[str, StagedRequest],
    answers: RenderAnswers | None,
) -> list[ledger.items.NewItem]:
    hashes = _hashes(spec, rows, requests)
    keys = answers.keys(spec, requests) if answers is not None else {}
    items = []
    for row, prompt_hash in hashes:
        lead_key, cache_key = keys.get(row.item_id, (None, None))
        items.append(
            ledger.items.NewItem(
                row.item_id, row.ordinal, prompt_hash, row.source, cache_key, lead_key
            )
        )
    return items


def _templated(rows: list[StagedRow], fmt: InputFormat) -> list[int]:
    """Positions of the rows whose prompt comes from the job's template."""
    if fmt is InputFormat.OPENAI:
        return []
    return [i for i, row in enumerate(rows) if row.error_class is None and row.fields is not None]


def _render(
    spec: JobSpec,
    fmt: InputFormat,
    rows: list[StagedRow],
    *,
    shard: int,
    overrides: dict[str, Any],
    rendered: Mapping[int, Rendered],
) -> tuple[dict[str, StagedRequest], list[ledger.items.DeadItem]]:
    """Staged requests and dead items for ``rows``; ``rendered`` holds the template's
    outcome for the rows at the positions :func:`_templated` gives."""
    if spec.task is Task.EMBED:
        return _render_embed(spec, fmt, rows, shard=shard, overrides=overrides, rendered=rendered)
    # A re-drive's sampling fields win over the job's and the request's own.
    default = spec.sampling.with_overrides(overrides)
    requests: dict[str, StagedRequest] = {}
    dead: list[ledger.items.DeadItem] = []
    # Lines asking the same sampling share one object (openai_requests.parse), so whether
    # it is the job's own is worked out once per object, not once per row.
    samplings: dict[bytes, SamplingSpec] = {}
    # And lines repeating a body share what it parsed to (openai_requests.parse).
    bodies: dict[bytes, openai_requests.ParsedRequest] = {}
    own: dict[int, tuple[SamplingSpec, bool]] = {}

    def staged_sampling(sampling: SamplingSpec) -> SamplingSpec | None:
        """None stands for the job's own sampling: not repeated on every staged row."""
        known = own.get(id(sampling))
        if known is None or known[0] is not sampling:
            known = own[id(sampling)] = (sampling, sampling == spec.sampling)
        return None if known[1] else sampling

    def fail(row: StagedRow, error_class: ErrorClass, message: str) -> None:
        dead.append(
            ledger.items.DeadItem(
                item_id=row.item_id,
                shard=shard,
                error_class=error_class,
                error_message=message,
                source=row.source,
            )
        )

    for index, row in enumerate(rows):
        if row.error_class is not None or row.fields is None:
            fail(
                row, row.error_class or ErrorClass.INVALID_ROW, row.error or "row could not be read"
            )
            continue
        prompt: str | None = None
        prompt_ids: list[int] | None = None
        messages: list[dict[str, str]] | None
        if fmt is InputFormat.OPENAI:
            try:
                parsed = openai_requests.parse(
                    row.fields,
                    defaults=spec.sampling,
                    model=spec.model,
                    endpoint=spec.endpoint,
                    samplings=samplings,
                    bodies=bodies,
                )
            except openai_requests.InvalidRequest as exc:
                fail(row, ErrorClass.INVALID_REQUEST, str(exc))
                continue
            messages, prompt, prompt_ids = parsed.messages, parsed.prompt, parsed.prompt_token_ids
            sampling = parsed.sampling.with_overrides(overrides)
        else:
            outcome = rendered[index]
            if isinstance(outcome, TemplateError):
                # Whatever failed (the template, its time or size limit): this row only.
                fail(row, ErrorClass.TEMPLATE_ERROR, str(outcome))
                continue
            messages = outcome
            sampling = default
        requests[row.item_id] = StagedRequest(
            item_id=row.item_id,
            source=row.source,
            messages=messages,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            sampling=staged_sampling(sampling),
        )
    return requests, dead


def _render_embed(
    spec: JobSpec,
    fmt: InputFormat,
    rows: list[StagedRow],
    *,
    shard: int,
    overrides: dict[str, Any],
    rendered: Mapping[int, Rendered],
) -> tuple[dict[str, StagedRequest], list[ledger.items.DeadItem]]:
    """:func:`_render` for an embed job: each row's texts to embed. A re-drive's
    ``truncate_prompt_tokens`` wins over the job's and the line's own options."""
    job_options = spec.embed_options
    default = job_options.with_overrides(overrides)
    requests: dict[str, StagedRequest] = {}
    dead: list[ledger.items.DeadItem] = []
    for index, row in enumerate(rows):
        failure: tuple[ErrorClass, str] | None = None
        texts: list[str] = []
        token_ids: list[list[int]] | None = None
        options = default
        if row.error_class is not None or row.fields is None:
            failure = (
                row.error_class or ErrorClass.INVALID_ROW,
                row.error or "row could not be read",
            )
        elif fmt is InputFormat.OPENAI:
            try:
                _, texts, token_ids, own = openai_requests.parse_embedding_request(
                    row.fields, defaults=job_options, model=spec.model
                )
                options = own.with_overrides(overrides)
            except openai_requests.InvalidRequest as exc:
                failure = (ErrorClass.INVALID_REQUEST, str(exc))
        else:
            outcome = rendered[index]
            if isinstance(outcome, TemplateError):
                failure = (ErrorClass.TEMPLATE_ERROR, str(outcome))
            else:
                texts = [outcome[0]["content"]]
                if not texts[0]:
                    failure = (ErrorClass.INVALID_PROMPT, "the text to embed is empty")
        if failure is not None:
            dead.append(
                ledger.items.DeadItem(
                    item_id=row.item_id,
                    shard=shard,
                    error_class=failure[0],
                    error_message=failure[1],
                    source=row.source,
                )
            )
            continue
        requests[row.item_id] = StagedRequest(
            item_id=row.item_id,
            source=row.source,
            texts=texts or None,
            token_ids=token_ids,
            embedding=None if options == job_options else options,
        )
    return requests, dead


def _hashes(
    spec: JobSpec, rows: list[StagedRow], requests: dict[str, StagedRequest]
) -> list[tuple[StagedRow, str | None]]:
    # The dedup key (llmbatch.dedup.request_key): what decides the request's result.
    out: list[tuple[StagedRow, str | None]] = []
    # (messages, sampling) objects -> their key. Rows repeating a line's body share
    # its messages and sampling objects (_render), so a repeat's key is found, not
    # hashed again; the requests hold the objects, so their ids are not reused here.
    keys: dict[tuple[int, int], str] = {}
    for row in rows:
        request = requests.get(row.item_id)
        if request is None:
            out.append((row, None))
            continue
        sampling = request.effective_sampling(spec)
        chat = request.messages is not None and request.prompt is None
        shared = (
            (id(request.messages), id(sampling))
            if chat
            and request.prompt_token_ids is None
            and not (request.texts or request.token_ids)
            else None
        )
        known = keys.get(shared) if shared is not None else None
        if known is not None:
            request.key = known
            out.append((row, known))
            continue
        key = request_key(
            model=spec.model,
            messages=request.messages,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling,
            texts=request.texts,
            token_ids=request.token_ids,
            embedding=request.embedding
            or (spec.embed_options if request.texts or request.token_ids else None),
        )
        request.key = key  # staged with the request: generate groups by it
        if shared is not None:
            keys[shared] = key
        out.append((row, key))
    return out
