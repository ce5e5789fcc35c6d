"""Read: a shard's rows from the input, each with its item id
(:class:`~llmbatch.formats.records.StagedRow`), the first stage of its item path.

A row that cannot be read, or has no item id of its own, still comes out, with the
reason: rendering sends it to the dead list, so every row is accounted for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from temporalio.exceptions import ApplicationError

from llmbatch import formats, telemetry
from llmbatch.config import Settings
from llmbatch.contract.messages import FetchResult, ShardInput
from llmbatch.contract.spec import InputFormat, JobSpec
from llmbatch.contract.states import ErrorClass, FailureType
from llmbatch.formats.records import StagedRow
from llmbatch.stages.context import PrepareContext
from llmbatch.storage.base import ObjectStore
from llmbatch.tables import jobs as tables
from llmbatch.tables.connect import TableError


async def read_shard(ctx: PrepareContext, input: ShardInput) -> tuple[list[StagedRow], FetchResult]:
    """The shard's rows from the input (its row range, by its plan), with item ids,
    and how many there are and how many of them could not be read."""
    layout = input.layout
    plan = formats.ShardPlan.model_validate_json(await ctx.read(layout.shard_plan(input.shard)))
    store = None if layout.input_format is InputFormat.TABLE else ctx.store(plan.uri)
    with telemetry.span(
        "shard.read_input",
        shard=input.shard,
        format=layout.input_format.value,
        # JSONL and CSV shards are byte ranges; Parquet shards row groups.
        bytes=plan.end - plan.start if plan.end else None,
    ) as span:
        rows = await read_staged_rows(
            ctx.settings, store, plan, layout.input_format, spec=input.spec
        )
        invalid = sum(r.fields is None for r in rows)
        span.set_attributes(telemetry.attrs(rows=len(rows), invalid_rows=invalid))
    telemetry.annotate(job_id=input.spec.job_id, shard=input.shard, rows=len(rows))
    return rows, FetchResult(rows=len(rows), invalid=invalid)


async def read_staged_rows(
    settings: Settings,
    store: ObjectStore | None,
    plan: formats.ShardPlan,
    fmt: InputFormat,
    *,
    spec: JobSpec,
) -> list[StagedRow]:
    """One shard's rows with their item ids, as ``prepare_shard`` reads them (and
    ``submit --estimate`` counts them); ``store`` is None for a table."""
    if fmt is InputFormat.TABLE:
        return await _read_table_rows(settings, plan, max_row_bytes=spec.max_row_bytes)
    return await asyncio.to_thread(
        _read_rows, store, plan, fmt, id_field=spec.id_field, max_row_bytes=spec.max_row_bytes
    )


async def _read_table_rows(
    settings: Settings, plan: formats.ShardPlan, *, max_row_bytes: int
) -> list[StagedRow]:
    """A table shard's rows, keyed by its key column."""
    try:
        rows = await tables.read_shard(plan, settings, max_row_bytes=max_row_bytes)
    except TableError as exc:
        raise ApplicationError(str(exc), type=FailureType.TABLE_ERROR, non_retryable=True) from exc
    return _stage(rows, id_field=plan.id_field)


def _read_rows(
    store: object,
    plan: formats.ShardPlan,
    fmt: InputFormat,
    *,
    id_field: str | None,
    max_row_bytes: int,
) -> list[StagedRow]:
    if id_field is None and fmt is InputFormat.OPENAI:
        id_field = "custom_id"
    rows = formats.read_shard(store, plan, fmt, max_row_bytes=max_row_bytes)  # type: ignore[arg-type]
    return _stage(rows, id_field=id_field)


def _stage(rows: Iterable[formats.SourceRow], *, id_field: str | None) -> list[StagedRow]:
    """Rows with their item ids; a row without an id, or repeating one, is dead-lettered."""
    staged: list[StagedRow] = []
    seen: set[str] = set()
    for row in rows:
        fallback_id = f"row-{row.ordinal}"
        if row.fields is None:
            staged.append(
                StagedRow(
                    item_id=fallback_id,
                    ordinal=row.ordinal,
                    source=row.source,
                    error_class=row.error_class or ErrorClass.INVALID_ROW,
                    error=row.error,
                )
            )
            continue
        item_id, error = fallback_id, None
        if id_field is not None:
            value = row.fields.get(id_field)
            if value is None or value == "":
                error = f"id field {id_field!r} is missing or empty"
            else:
                item_id = str(value)
        if error is None and item_id in seen:
            # Only the first row with an id runs; the copy is dead-lettered, not dropped.
            error, item_id = (
                f"item id {item_id!r} repeats an earlier row",
                f"{item_id}#{fallback_id}",
            )
        seen.add(item_id)
        staged.append(
            StagedRow(
                item_id=item_id,
                ordinal=row.ordinal,
                source=row.source,
                fields=row.fields,
                error_class=None if error is None else ErrorClass.INVALID_ITEM_ID,
                error=error,
            )
        )
    return staged
