"""write_shard: ledger + staged rows → the shard's output part, under a fixed key."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.context import ActivityContext
from llmbatch import formats, ledger, openai_batch, telemetry
from llmbatch.contract.messages import ShardInput, ShardSummary, TokenCounts
from llmbatch.contract.names import WRITE_SHARD
from llmbatch.contract.spec import InputFormat, JobSpec, OutputFormat
from llmbatch.contract.states import TERMINAL_STATUSES, ItemStatus
from llmbatch.records import StagedRow, load_jsonl


class WriteActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=WRITE_SHARD)
    async def write_shard(self, input: ShardInput) -> ShardSummary:
        """Write one output row per item of the shard; a retry rewrites the same object."""
        spec, layout, shard = input.spec, input.layout, input.shard
        rows = {
            r.item_id: r
            for r in load_jsonl(await self._ctx.read(layout.shard_rows(shard)), StagedRow)
        }
        entries = await ledger.shard_results(self._ctx.pool, job_id=spec.job_id, shard=shard)
        unfinished = [e.item_id for e in entries if e.status not in TERMINAL_STATUSES]
        if unfinished:
            raise ApplicationError(
                f"shard {shard} has {len(unfinished)} unfinished items (first: {unfinished[0]!r})",
                type="IncompleteShard",
                non_retryable=True,
            )
        summary = ShardSummary(shard=shard, items=len(entries))
        tokens = TokenCounts()
        for e in entries:
            if e.status is ItemStatus.SUCCEEDED:
                summary.succeeded += 1
                tokens = tokens + TokenCounts(
                    prompt=e.prompt_tokens or 0, completion=e.completion_tokens or 0
                )
            else:
                summary.dead += 1
        summary.tokens = tokens
        summary.usage = await ledger.usage(self._ctx.pool, job_id=spec.job_id, shard=shard)
        telemetry.annotate(
            job_id=spec.job_id,
            shard=shard,
            items=summary.items,
            succeeded=summary.succeeded,
            dead=summary.dead,
        )

        if layout.input_format is InputFormat.OPENAI:
            out_rows, err_rows = _openai_lines(spec, entries)
            part = layout.output_part(shard, "jsonl")
            await self._ctx.write(part, formats.write_jsonl(out_rows))
        else:
            out = [_output_row(spec, e, rows.get(e.item_id)) for e in entries]
            err_rows = [_error_line(e) for e in entries if e.status is ItemStatus.DEAD]
            if spec.output_format is OutputFormat.PARQUET:
                part = layout.output_part(shard, "parquet")
                await self._ctx.write(part, formats.write_parquet(out))
            else:
                part = layout.output_part(shard, "jsonl")
                await self._ctx.write(part, formats.write_jsonl(out))
        summary.output_parts.append(part)
        errors = layout.error_part(shard)
        if err_rows:
            await self._ctx.write(errors, formats.write_jsonl(err_rows))
            summary.output_parts.append(errors)
        else:
            # A re-drive can leave a shard without errors: its old error file must go.
            store = self._ctx.store(errors)
            await asyncio.to_thread(store.delete_prefix, errors)
        return summary


def _error_line(entry: ledger.LedgerRow) -> dict[str, Any]:
    return {
        "item_id": entry.item_id,
        "error": {
            "class": entry.error_class,
            "message": entry.error_message,
            "source": entry.source,
            "attempts": entry.attempt,
        },
    }


def _output_row(spec: JobSpec, entry: ledger.LedgerRow, row: StagedRow | None) -> dict[str, Any]:
    fields = (row.fields if row is not None else None) or {}
    if spec.output_fields is not None:
        fields = {k: fields.get(k) for k in spec.output_fields}
    result = entry.result or {}
    error = None
    if entry.status is ItemStatus.DEAD:
        error = {
            "class": entry.error_class,
            "message": entry.error_message,
            "source": entry.source,
        }
    return {
        "item_id": entry.item_id,
        "input": fields,
        "text": result.get("text"),
        "parsed": result.get("parsed"),
        "finish_reason": result.get("finish_reason"),
        "prompt_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens,
        # How the result came (generated, deduplicated, cached) and whose it is: an item
        # id of this job, or "<job>/<item>" of the earlier job a cached result came from.
        "result_source": entry.result_source,
        "shared_with": entry.shared_with,
        "error": error,
    }


def _openai_lines(
    spec: JobSpec, entries: list[ledger.LedgerRow]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out, errors = [], []
    for e in entries:
        if e.status is ItemStatus.SUCCEEDED:
            result = e.result or {}
            out.append(
                openai_batch.output_line(
                    job_id=spec.job_id,
                    custom_id=e.item_id,
                    model=spec.model,
                    text=result.get("text") or "",
                    finish_reason=result.get("finish_reason"),
                    prompt_tokens=e.prompt_tokens or 0,
                    completion_tokens=e.completion_tokens or 0,
                    created=int(e.finished_at.timestamp()) if e.finished_at else 0,
                    endpoint=spec.api_batch.endpoint
                    if spec.api_batch
                    else openai_batch.ApiEndpoint.CHAT_COMPLETIONS,
                )
            )
        else:
            errors.append(
                openai_batch.error_line(
                    job_id=spec.job_id,
                    custom_id=e.item_id,
                    code=e.error_class or "error",
                    message=f"{e.error_message} ({e.source})",
                )
            )
    return out, errors
