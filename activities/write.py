"""write_shard: ledger + staged rows → the shard's output part, under a fixed key."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pyarrow as pa
from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch import formats, ledger, storage, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import ShardInput, ShardSummary, TokenCounts
from llmbatch.contract.names import WRITE_SHARD
from llmbatch.contract.spec import InputFormat, JobSpec, OutputFormat, Task
from llmbatch.contract.states import TERMINAL_STATUSES, FailureType, ItemStatus
from llmbatch.formats import openai_output, openai_requests
from llmbatch.formats.records import StagedRow, load_jsonl
from llmbatch.formats.vectors import StagedVectors, Vectors, floats, read_vectors
from llmbatch.tables import jobs as tables
from llmbatch.tables.connect import TableError

log = logging.getLogger(__name__)


def reads_staged_rows(spec: JobSpec, fmt: InputFormat) -> bool:
    """Whether ``write_shard`` reads the shard's staged rows: their fields go into the
    output, except for OpenAI batch lines answered with completions, whose lines are
    made from the ledger alone (so ``prepare_shard`` does not stage those rows at all)."""
    openai_text = fmt is InputFormat.OPENAI and spec.task is Task.GENERATE
    return not openai_text or spec.table_output


class WriteActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=WRITE_SHARD)
    async def write_shard(self, input: ShardInput) -> ShardSummary:
        """Write one output row per item of the shard; a retry rewrites the same object."""
        return await write_part(self._ctx, input)


async def write_part(
    ctx: ActivityContext, input: ShardInput, *, staged: list[StagedRow] | None = None
) -> ShardSummary:
    """The shard's output part and error file from the ledger (and its staged rows, when
    their fields go into the output): ``write_shard``'s work, and ``prepare_shard``'s for
    a shard it answered whole. ``staged``: the rows as staged, when the caller holds them."""
    spec, layout, shard = input.spec, input.layout, input.shard
    rows: dict[str, StagedRow] = {}
    if reads_staged_rows(spec, layout.input_format):
        if staged is None:
            staged = list(load_jsonl(await ctx.read(layout.shard_rows(shard)), StagedRow))
        rows = {r.item_id: r for r in staged}
    entries = await ledger.items.shard_results(ctx.pool, job_id=spec.job_id, shard=shard)
    unfinished = [e.item_id for e in entries if e.status not in TERMINAL_STATUSES]
    if unfinished:
        raise ApplicationError(
            f"shard {shard} has {len(unfinished)} unfinished items (first: {unfinished[0]!r})",
            type=FailureType.INCOMPLETE_SHARD,
            non_retryable=True,
        )
    summary = ShardSummary(shard=shard, items=len(entries))
    succeeded = [e for e in entries if e.status is ItemStatus.SUCCEEDED]
    summary.succeeded, summary.dead = len(succeeded), len(entries) - len(succeeded)
    summary.tokens = TokenCounts(
        prompt=sum(e.prompt_tokens or 0 for e in succeeded),
        completion=sum(e.completion_tokens or 0 for e in succeeded),
    )
    summary.usage = await ledger.usage.usage(ctx.pool, job_id=spec.job_id, shard=shard)
    telemetry.annotate(
        job_id=spec.job_id,
        shard=shard,
        items=summary.items,
        succeeded=summary.succeeded,
        dead=summary.dead,
    )

    if spec.table_output:
        # Upserted by item id in one transaction: a retry rewrites the same rows.
        vectors = None
        if spec.task is Task.EMBED:
            vectors = await read_vectors(ctx.read, entries)
        try:
            await tables.write_shard(spec, ctx.settings, entries, rows, vectors)
        except TableError as exc:
            raise ApplicationError(
                str(exc), type=FailureType.TABLE_ERROR, non_retryable=True
            ) from exc
        err_rows = [_error_line(e) for e in entries if e.status is ItemStatus.DEAD]
        part = spec.output_uri
    elif spec.task is Task.EMBED:
        # Bounded memory: only this shard's vectors are read, object by object.
        vectors = await read_vectors(ctx.read, entries)
        if layout.input_format is InputFormat.OPENAI:
            lines, err_rows = _openai_lines(spec, entries, rows, vectors)
            part = layout.output_part(shard, "jsonl")
            await ctx.write(part, lines)
        else:
            err_rows = [_error_line(e) for e in entries if e.status is ItemStatus.DEAD]
            part = layout.output_part(shard, spec.output_format.value)
            await ctx.write(part, _embedding_part(spec, entries, rows, vectors))
    elif layout.input_format is InputFormat.OPENAI:
        lines, err_rows = _openai_lines(spec, entries, rows)
        part = layout.output_part(shard, "jsonl")
        await ctx.write(part, lines)
    else:
        out = [_output_row(spec, e, rows.get(e.item_id)) for e in entries]
        err_rows = [_error_line(e) for e in entries if e.status is ItemStatus.DEAD]
        if spec.output_format is OutputFormat.PARQUET:
            part = layout.output_part(shard, "parquet")
            await ctx.write(part, formats.write_parquet(out))
        else:
            part = layout.output_part(shard, "jsonl")
            await ctx.write(part, formats.write_jsonl(out))
    if spec.task is Task.EMBED:
        await _sweep_vectors(ctx, layout.vectors_folder(shard), entries)
    summary.output_parts.append(part)
    errors = layout.error_part(shard)
    if err_rows:
        await ctx.write(errors, formats.write_jsonl(err_rows))
        summary.output_parts.append(errors)
    else:
        # A re-drive can leave a shard without errors: its old error file must go.
        await asyncio.to_thread(ctx.store(errors).delete, errors)
    return summary


async def _sweep_vectors(
    ctx: ActivityContext, folder: str, entries: list[ledger.items.LedgerRow]
) -> int:
    """Delete the shard's vector objects that none of its items points to: those of
    attempts that crashed or were superseded between writing an object and recording
    it (their items were embedded again). Return how many went.

    Only this shard's items can point here (a repeat in another shard copies the
    pointer of its lead, which is in this shard and stays), and every item is
    finished, so no live attempt is about to record an object. Objects are compared
    by name: the folder is the shard's, and names are unique per attempt and flush.
    """
    kept = set()
    for e in entries:
        staged = StagedVectors.of(e.result)
        if staged is not None:
            kept.add(staged.vectors.rsplit("/", 1)[-1])
    store = ctx.store(folder)
    try:
        objects = await asyncio.to_thread(store.list, folder)
    except storage.base.InputNotFound:
        return 0  # nothing was embedded (every item died)
    stray = [o.uri for o in objects if o.uri.rsplit("/", 1)[-1] not in kept]
    for uri in stray:
        await asyncio.to_thread(store.delete_prefix, uri)
    if stray:
        log.info("deleted %d vector objects no item points to under %s", len(stray), folder)
    return len(stray)


def _dead_line(spec: JobSpec, entry: ledger.items.LedgerRow) -> dict[str, Any]:
    """A dead item of OpenAI batch input, as the error file's line."""
    return openai_output.dead_line(
        job_id=spec.job_id,
        custom_id=entry.item_id,
        error_class=entry.error_class,
        message=entry.error_message,
        source=entry.source,
    )


def _error_line(entry: ledger.items.LedgerRow) -> dict[str, Any]:
    return {
        "item_id": entry.item_id,
        "error": {
            "class": entry.error_class,
            "message": entry.error_message,
            "source": entry.source,
            "attempts": entry.attempt,
        },
    }


def _output_row(
    spec: JobSpec, entry: ledger.items.LedgerRow, row: StagedRow | None
) -> dict[str, Any]:
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


def _embedding_part(
    spec: JobSpec,
    entries: list[ledger.items.LedgerRow],
    rows: dict[str, StagedRow],
    vectors: Vectors,
) -> bytes:
    """An embed job's output part: one row per item with its id, the chosen input
    fields, the vector (Parquet: a fixed-size list<float32> column; JSONL: an array of
    floats), its token count and, for a dead item, the error."""
    out: list[dict[str, Any]] = []
    for e in entries:
        staged = rows.get(e.item_id)
        fields = (staged.fields if staged is not None else None) or {}
        if spec.output_fields is not None:
            fields = {k: fields.get(k) for k in spec.output_fields}
        error = None
        if e.status is ItemStatus.DEAD:
            error = {"class": e.error_class, "message": e.error_message, "source": e.source}
        out.append(
            {
                "item_id": e.item_id,
                "input": fields,
                "prompt_tokens": e.prompt_tokens,
                "error": error,
            }
        )
    own = [vectors.get(e.item_id, [b""])[0] or None for e in entries]
    if spec.output_format is OutputFormat.JSONL:
        for row, vector in zip(out, own, strict=True):
            row["embedding"] = None if vector is None else floats(vector)
        return formats.write_jsonl(out)
    # Parquet: the input fields as columns of their own, beside the vector column.
    flat = [{"item_id": r.pop("item_id"), **r.pop("input"), **r} for r in out]
    for row in flat:
        row.pop("embedding", None)  # an input field of that name gives way to the vector
    return formats.write_parquet(flat, arrays={"embedding": (-2, _vector_column(own))})


def _vector_column(vectors: list[bytes | None]) -> pa.Array:
    """Vectors as one Arrow column: ``fixed_size_list<float32>[d]`` when all have one
    dimension (what vector stores and pandas/polars/duckdb take as is), else a list."""
    sizes = {len(v) // 4 for v in vectors if v is not None}
    valid = [v is not None for v in vectors]
    if len(sizes) <= 1:
        size = sizes.pop() if sizes else 1
        flat = b"".join(v if v is not None else bytes(4 * size) for v in vectors)
        values = pa.Array.from_buffers(pa.float32(), len(flat) // 4, [None, pa.py_buffer(flat)])
        return pa.FixedSizeListArray.from_arrays(
            values, size, mask=pa.array([not ok for ok in valid])
        )
    return pa.array(
        [None if v is None else floats(v) for v in vectors], type=pa.list_(pa.float32())
    )


def _openai_lines(
    spec: JobSpec,
    entries: list[ledger.items.LedgerRow],
    rows: dict[str, StagedRow],
    vectors: Vectors | None = None,
) -> tuple[bytes, list[dict[str, Any]]]:
    """A shard of OpenAI batch input: its output part (JSONL) and its error lines."""
    out = bytearray()
    errors = []
    chat = openai_output.ChatLines(spec) if vectors is None else None
    for e in entries:
        if e.status is not ItemStatus.SUCCEEDED:
            errors.append(_dead_line(spec, e))
            continue
        if chat is not None and chat.encode_into(out, e):
            continue
        encoding = "float"
        if vectors is not None:
            staged = rows.get(e.item_id)
            body = ((staged.fields if staged is not None else None) or {}).get("body")
            # Validated at render, so the line's format is one of the two.
            encoding = openai_requests.encoding_format(body)
        out += formats.write_jsonl(
            [
                openai_output.result_line(
                    spec,
                    e,
                    vectors=None if vectors is None else vectors.get(e.item_id),
                    encoding=encoding,
                )
            ]
        )
    return bytes(out), errors
