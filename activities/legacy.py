"""Steps kept only for shards started before ``prepare_shard`` existed: such a shard's
history records ``fetch_shard`` (read the rows, stage them) and then ``render_prompts``
(render the staged rows and register them), and a worker must still run them while
any such shard is open. Both are adapters over the same stages as ``prepare_shard``
(:mod:`llmbatch.activities.prepare`); only their names and the staged rows between
them differ. Nothing new calls them.

They go the way of Temporal's patching (its samples: ``patched`` → ``deprecate_patch``
→ removed), on the patch id ``prepare_shard`` (:data:`llmbatch.contract.names.PREPARE_SHARD`)
in :mod:`llmbatch.workflows.shard`:

1. ``patched`` (now): ``input.prepare_first or workflow.patched(PREPARE_SHARD)`` runs
   ``prepare_shard``; a history without the marker (and without ``prepare_first``)
   replays these two steps, which the CPU worker registers.
2. ``deprecate_patch``: once no shard started before the patch is open (none that
   ``llm-batch status`` or the Web UI lists runs the two steps), the branch becomes
   ``workflow.deprecate_patch(PREPARE_SHARD)`` followed by ``prepare_shard`` alone;
   this module, its registration in ``workers/cpu.py``, ``FETCH_SHARD`` and
   ``RENDER_PROMPTS`` go, and so do the recorded histories that ran them
   (``tests/workflows/histories``, the ``ShardWorkflow`` runs of releases before the
   patch), which could no longer replay.
3. Removed: once no open shard's history holds the marker of step 1 (every shard
   started under ``patched`` has closed), the ``deprecate_patch`` call goes too.
"""

from __future__ import annotations

from temporalio import activity

from llmbatch.activities.context import ActivityContext
from llmbatch.activities.prepare import render_and_register
from llmbatch.contract.messages import FetchResult, RenderResult, ShardInput
from llmbatch.contract.names import FETCH_SHARD, RENDER_PROMPTS
from llmbatch.formats.records import StagedRow, dump_jsonl, load_jsonl
from llmbatch.stages import read


class LegacyActivities:
    """``fetch_shard`` and ``render_prompts``, the two steps ``prepare_shard`` replaced."""

    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=FETCH_SHARD)
    async def fetch_shard(self, input: ShardInput) -> FetchResult:
        """Read the shard's row range and stage the rows with their item ids."""
        rows, fetched = await read.read_shard(self._ctx, input)
        await self._ctx.write(input.layout.shard_rows(input.shard), dump_jsonl(rows))
        return fetched

    @activity.defn(name=RENDER_PROMPTS)
    async def render_prompts(self, input: ShardInput) -> RenderResult:
        """Render the rows ``fetch_shard`` staged and register them."""
        rows = list(
            load_jsonl(await self._ctx.read(input.layout.shard_rows(input.shard)), StagedRow)
        )
        return await render_and_register(self._ctx, input, rows)
