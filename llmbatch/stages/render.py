"""Render: a shard's rows into generation (or embedding) requests
(:class:`~llmbatch.formats.records.StagedRequest`), each with its request key, and
the rows that can never run (:class:`~llmbatch.ledger.items.DeadItem`: unreadable,
a template error, an invalid request), each for this row only.

Templates render in the worker's render processes (:mod:`llmbatch.rendering.pool`);
OpenAI batch lines are parsed (:mod:`llmbatch.formats.openai_requests`), lines repeating
a body sharing what it parsed to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmbatch.contract.spec import InputFormat, JobSpec, SamplingSpec, Task
from llmbatch.contract.states import ErrorClass
from llmbatch.dedup.keys import request_key
from llmbatch.formats import openai_requests
from llmbatch.formats.records import StagedRequest, StagedRow
from llmbatch.ledger.items import DeadItem
from llmbatch.rendering.pool import Rendered, RenderPool
from llmbatch.rendering.templates import TemplateError


async def render_rows(
    renders: RenderPool,
    spec: JobSpec,
    fmt: InputFormat,
    rows: list[StagedRow],
    *,
    shard: int,
    overrides: dict[str, Any],
) -> tuple[dict[str, StagedRequest], list[DeadItem]]:
    """Staged requests (by item id, each with its request key) and dead items for a
    shard's ``rows``, as ``prepare_shard`` makes them (and ``submit --estimate``
    counts them)."""
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
    requests, dead = _render(
        spec,
        fmt,
        rows,
        shard=shard,
        overrides=overrides,
        rendered=dict(zip(templated, outcomes, strict=True)),
    )
    _key_requests(spec, requests)
    return requests, dead


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
) -> tuple[dict[str, StagedRequest], list[DeadItem]]:
    """Staged requests and dead items for ``rows``; ``rendered`` holds the template's
    outcome for the rows at the positions :func:`_templated` gives."""
    if spec.task is Task.EMBED:
        return _render_embed(spec, fmt, rows, shard=shard, overrides=overrides, rendered=rendered)
    # A re-drive's sampling fields win over the job's and the request's own.
    default = spec.sampling.with_overrides(overrides)
    requests: dict[str, StagedRequest] = {}
    dead: list[DeadItem] = []
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
            DeadItem(
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
) -> tuple[dict[str, StagedRequest], list[DeadItem]]:
    """:func:`_render` for an embed job: each row's texts to embed. A re-drive's
    ``truncate_prompt_tokens`` wins over the job's and the line's own options."""
    job_options = spec.embed_options
    default = job_options.with_overrides(overrides)
    requests: dict[str, StagedRequest] = {}
    dead: list[DeadItem] = []
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
                DeadItem(
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


def _key_requests(spec: JobSpec, requests: dict[str, StagedRequest]) -> None:
    """Give each request its key (:func:`llmbatch.dedup.keys.request_key`): what
    decides its result, the ledger's ``prompt_hash`` and what deduplication and the
    result cache go by. Staged with the request: generate groups by it."""
    # (messages, sampling) objects -> their key. Rows repeating a line's body share
    # its messages and sampling objects (_render), so a repeat's key is found, not
    # hashed again; the requests hold the objects, so their ids are not reused here.
    keys: dict[tuple[int, int], str] = {}
    for request in requests.values():
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
        request.key = key
        if shared is not None:
            keys[shared] = key
