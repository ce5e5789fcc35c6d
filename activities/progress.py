"""count_running_items: what a job's running shards have recorded so far.

BatchJobWorkflow counts a shard's items when the shard ends; between, its search
attributes and details line take this reading, at most every ``progress_every`` (one
small indexed query a job per interval, never a signal per item).
"""

from __future__ import annotations

from temporalio import activity

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import RunningItems, RunningItemsInput
from llmbatch.contract.names import COUNT_RUNNING_ITEMS


class ProgressActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=COUNT_RUNNING_ITEMS)
    async def count_running_items(self, input: RunningItemsInput) -> RunningItems:
        """The ledger's counts of ``input.shards``, by shard."""
        return RunningItems(
            shards=await ledger.jobs.shard_counts(
                self._ctx.pool, job_id=input.job_id, shards=input.shards
            )
        )
