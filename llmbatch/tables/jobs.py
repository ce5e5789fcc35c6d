"""What planning, prepare_shard and write_shard call for a job with a table in or out.

Every function raises :class:`~llmbatch.formats.planning.InvalidJobSpec` at planning for a job
that can never run, :class:`~llmbatch.tables.connect.TableError` later for a database
error no retry cures, and lets transient errors through for Temporal to retry.
"""

from __future__ import annotations

from typing import Any

from llmbatch.config import Settings
from llmbatch.contract.spec import InputFormat, JobSpec
from llmbatch.contract.tables import TableUri, parse_table_uri
from llmbatch.formats import planning
from llmbatch.formats.readers import SourceRow
from llmbatch.formats.shards import ShardPlan
from llmbatch.rendering.limits import RenderLimits
from llmbatch.tables import sink, source
from llmbatch.tables.connect import TableError, connect

# Where a job with a table output keeps its own objects when the spec names no work_uri.
WORK_PREFIX = "tables"


def work_root(spec: JobSpec, settings: Settings) -> str:
    """The job's own folder (plans, staging, error parts, manifest): under
    ``<output_uri>`` for a file output, under ``work_uri`` for a table output."""
    if not spec.table_output:
        return f"{spec.output_uri.rstrip('/')}/{spec.job_id}"
    base = spec.work_uri or f"s3://{settings.s3_bucket}/{WORK_PREFIX}"
    return f"{base.rstrip('/')}/{spec.job_id}"


async def check_table_job(
    spec: JobSpec, settings: Settings, limits: RenderLimits, *, create_output: bool
) -> list[ShardPlan] | None:
    """The table parts of a job checked: its input table or query (fields, key, the
    prompt on the first row; then planned into key-range shards, returned) and its
    output table (compatible, or created when ``create_output``). ``llm-batch submit``
    checks without creating; ``plan_job`` creates."""
    shards = None
    try:
        if spec.table_input:
            table = parse_table_uri(spec.inputs[0])
            async with connect(table, settings) as conn:
                info = await source.inspect_source(conn, table, id_field=spec.id_field)
                if info.rows == 0:
                    raise TableError(f"input has no rows: {table.display}")
                planning.check_prompt(
                    spec,
                    fmt=InputFormat.TABLE,
                    fields=info.fields,
                    row=info.sample,
                    where=table.display,
                    limits=limits,
                )
                if create_output:
                    shards = await source.plan_key_ranges(
                        conn, table, info, shard_size=spec.shard_size
                    )
        if spec.table_output:
            out = parse_table_uri(spec.output_uri, output=True)
            async with connect(out, settings) as conn:
                if create_output:
                    await sink.prepare_output(conn, out, spec)
                else:
                    # Checked in a transaction rolled back: submit creates nothing.
                    tx = conn.transaction()
                    await tx.start()
                    try:
                        await sink.prepare_output(conn, out, spec)
                    finally:
                        await tx.rollback()
    except TableError as exc:
        raise planning.InvalidJobSpec(str(exc)) from exc
    return shards


async def read_shard(plan: ShardPlan, settings: Settings, *, max_row_bytes: int) -> list[SourceRow]:
    """A table shard's rows (streamed from the server, one snapshot)."""
    table = parse_table_uri(plan.uri)
    async with connect(table, settings) as conn:
        rows = source.read_shard(conn, table, plan, max_row_bytes=max_row_bytes)
        return [row async for row in rows]


async def write_rows(spec: JobSpec, settings: Settings, rows: list[dict[str, Any]]) -> int:
    """Upsert a shard's output rows (:class:`llmbatch.stages.encode.TableWriter`'s) into
    the job's output table."""
    table: TableUri = parse_table_uri(spec.output_uri, output=True)
    async with connect(table, settings) as conn:
        return await sink.upsert(conn, table, spec, rows)
