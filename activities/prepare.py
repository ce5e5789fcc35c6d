"""prepare_shard: a shard's first step, reading its rows and rendering them in one, and
writing its output part too when nothing is left to generate.

One activity instead of two (``fetch_shard``, then ``render_prompts``, kept in
:mod:`llmbatch.activities.legacy`) saves each shard a Temporal activity and the round
trip of its staged rows through the object store: the rows are rendered where they
were read. They are still staged when the write step reads them back
(:attr:`llmbatch.stages.encode.Writer.reads_rows`), before anything is registered, so
a retry finds them as a first attempt left them.

An adapter over the shard's stages (:mod:`llmbatch.stages`), in their order: read,
render, answer, register.
"""

from __future__ import annotations

from temporalio import activity

from llmbatch.activities.context import ActivityContext
from llmbatch.activities.heartbeat import step
from llmbatch.activities.write import write_part
from llmbatch.contract.messages import PrepareResult, RenderResult, ShardInput
from llmbatch.contract.names import PREPARE_SHARD
from llmbatch.formats.records import StagedRow, dump_jsonl
from llmbatch.stages import answer, encode, read, register, render


class PrepareActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=PREPARE_SHARD)
    async def prepare_shard(self, input: ShardInput) -> PrepareResult:
        """Read the shard's rows, render them and register them in the ledger."""
        rows, fetched = await read.read_shard(self._ctx, input)
        if encode.writer_for(input.spec, input.layout.input_format).reads_rows:
            await self._ctx.write(input.layout.shard_rows(input.shard), dump_jsonl(rows))
        rendered = await render_and_register(self._ctx, input, rows)
        # Nothing left to generate (a cached re-run, a shard the job's own leads
        # answered): the output part is written here. A write step of its own would
        # cost the shard an activity and a workflow task, a quarter of a cached shard's
        # events in Temporal. A retry redoes both halves, each idempotent.
        summary = None if rendered.to_generate else await write_part(self._ctx, input, staged=rows)
        return PrepareResult(**fetched.model_dump(), **rendered.model_dump(), summary=summary)


async def render_and_register(
    ctx: ActivityContext, input: ShardInput, rows: list[StagedRow]
) -> RenderResult:
    """The shard's read ``rows`` through the render, answer and register stages, in
    the current activity (which a wait for other shards' leads heartbeats)."""
    current = step()
    requests, dead = await render.render_rows(
        ctx.renders,
        input.spec,
        input.layout.input_format,
        rows,
        shard=input.shard,
        overrides=input.sampling_overrides,
    )
    answers = await answer.answer_shard(ctx, input, requests, step=current)
    return await register.register_shard(ctx, input, rows, requests, dead, answers, step=current)
