"""write_shard: ledger + staged rows → the shard's output part, under a fixed key.

The encoding is :mod:`llmbatch.stages.encode`'s (a writer per output kind); this reads
what the spec's writer needs, stores what it encodes, and returns where it went."""

from __future__ import annotations

import asyncio
import logging

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch import ledger, storage, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import ShardInput, ShardSummary
from llmbatch.contract.names import WRITE_SHARD
from llmbatch.contract.spec import Task
from llmbatch.contract.states import TERMINAL_STATUSES, FailureType
from llmbatch.formats.records import StagedRow, load_jsonl
from llmbatch.formats.vectors import StagedVectors, read_vectors
from llmbatch.stages import encode
from llmbatch.tables import jobs as tables
from llmbatch.tables.connect import TableError

log = logging.getLogger(__name__)


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
    writer = encode.writer_for(spec, layout.input_format)
    rows: dict[str, StagedRow] = {}
    if writer.reads_rows:
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
    summary = encode.summary(shard, entries)
    summary.usage = await ledger.usage.usage(ctx.pool, job_id=spec.job_id, shard=shard)
    telemetry.annotate(
        job_id=spec.job_id,
        shard=shard,
        items=summary.items,
        succeeded=summary.succeeded,
        dead=summary.dead,
    )

    # Bounded memory: only this shard's vectors are read, object by object.
    vectors = await read_vectors(ctx.read, entries) if writer.reads_vectors else {}
    encoded = writer.encode(entries, rows=rows, vectors=vectors)
    if writer.extension is None:
        # Upserted by item id in one transaction: a retry rewrites the same rows.
        try:
            await tables.write_rows(spec, ctx.settings, encoded.table_rows)
        except TableError as exc:
            raise ApplicationError(
                str(exc), type=FailureType.TABLE_ERROR, non_retryable=True
            ) from exc
        part = spec.output_uri
    else:
        part = layout.output_part(shard, writer.extension)
        await ctx.write(part, encoded.part)
    if spec.task is Task.EMBED:
        await _sweep_vectors(ctx, layout.vectors_folder(shard), entries)
    summary.output_parts.append(part)
    errors = layout.error_part(shard)
    if encoded.errors:
        await ctx.write(errors, encoded.errors)
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
