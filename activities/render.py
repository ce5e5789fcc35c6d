"""render_prompts: turn staged rows into generation requests, register them in the ledger."""

from __future__ import annotations

import hashlib
import json

from temporalio import activity

from activities.context import ActivityContext
from llmbatch import ledger, openai_batch, telemetry
from llmbatch.contracts import InputFormat, JobSpec
from llmbatch.pipeline import RENDER_PROMPTS, RenderResult, ShardInput
from llmbatch.records import StagedRequest, StagedRow, dump_jsonl, load_jsonl
from llmbatch.templates import PromptTemplate, TemplateError


class RenderActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=RENDER_PROMPTS)
    async def render_prompts(self, input: ShardInput) -> RenderResult:
        """Render every row; rows that can never run go to the dead list right here."""
        layout, spec, shard = input.layout, input.spec, input.shard
        rows = list(load_jsonl(await self._ctx.read(layout.shard_rows(shard)), StagedRow))
        requests, dead = _render(spec, layout.input_format, rows, shard=shard)

        new_items = [
            ledger.NewItem(
                item_id=row.item_id,
                ordinal=row.ordinal,
                prompt_hash=prompt_hash,
                source=row.source,
            )
            for row, prompt_hash in _hashes(rows, requests)
        ]
        done = await ledger.register_items(
            self._ctx.pool, job_id=spec.job_id, shard=shard, items=new_items
        )
        todo_dead = [d for d in dead if d.item_id not in done]
        if todo_dead:
            marked = await ledger.record_dead(
                self._ctx.pool, job_id=spec.job_id, lease_owner=None, items=todo_dead
            )
            telemetry.metrics().count_items(
                marked, job_id=spec.job_id, model=spec.model, status="dead"
            )
        todo = [r for r in requests.values() if r.item_id not in done]
        await self._ctx.write(layout.shard_requests(shard), dump_jsonl(todo))
        telemetry.annotate(
            job_id=spec.job_id, shard=shard, rows=len(rows), requests=len(todo), dead=len(todo_dead)
        )
        return RenderResult(to_generate=len(todo), already_done=len(done), dead=len(todo_dead))


def _render(
    spec: JobSpec, fmt: InputFormat, rows: list[StagedRow], *, shard: int
) -> tuple[dict[str, StagedRequest], list[ledger.DeadItem]]:
    template = PromptTemplate(spec.messages) if spec.messages else None
    requests: dict[str, StagedRequest] = {}
    dead: list[ledger.DeadItem] = []

    def fail(row: StagedRow, error_class: str, message: str) -> None:
        dead.append(
            ledger.DeadItem(
                item_id=row.item_id,
                shard=shard,
                error_class=error_class,
                error_message=message,
                source=row.source,
            )
        )

    for row in rows:
        if row.error_class is not None or row.fields is None:
            fail(row, row.error_class or "InvalidRow", row.error or "row could not be read")
            continue
        if fmt is InputFormat.OPENAI:
            try:
                _, messages, sampling = openai_batch.parse_request(
                    row.fields, defaults=spec.sampling
                )
            except openai_batch.InvalidRequest as exc:
                fail(row, "InvalidRequest", str(exc))
                continue
            requests[row.item_id] = StagedRequest(
                item_id=row.item_id,
                source=row.source,
                messages=messages,
                sampling=None if sampling == spec.sampling else sampling,
            )
        else:
            assert template is not None  # JobSpec refuses a non-OpenAI job without messages
            try:
                messages = template.render(row.fields)
            except TemplateError as exc:
                fail(row, "TemplateError", str(exc))
                continue
            requests[row.item_id] = StagedRequest(
                item_id=row.item_id, source=row.source, messages=messages
            )
    return requests, dead


def _hashes(
    rows: list[StagedRow], requests: dict[str, StagedRequest]
) -> list[tuple[StagedRow, str | None]]:
    out: list[tuple[StagedRow, str | None]] = []
    for row in rows:
        request = requests.get(row.item_id)
        if request is None:
            out.append((row, None))
            continue
        body = json.dumps(
            [request.messages, request.sampling.model_dump() if request.sampling else None],
            sort_keys=True,
        )
        out.append((row, hashlib.sha256(body.encode()).hexdigest()))
    return out
