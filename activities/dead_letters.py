"""Dead-letter activities: fail a shard for good, report dead items, requeue them.

They touch only Postgres (and Temporal, to signal the dead-letter workflow), so
they still work while the object store is down — the case that kills shards.
"""

from __future__ import annotations

from temporalio import activity

from llmbatch import ledger, telemetry
from llmbatch.activities.context import ActivityContext
from llmbatch.client import dead_letters as dead_letter_client
from llmbatch.contract.dead_letters import (
    FailShardInput,
    RequeueInput,
    RequeueResult,
    ShardDeadLetters,
)
from llmbatch.contract.messages import ShardCounts, ShardInput
from llmbatch.contract.names import (
    FAIL_SHARD,
    REPORT_DEAD_LETTERS,
    REQUEUE_DEAD_LETTERS,
)
from llmbatch.contract.states import ItemStatus

# A report lists at most this many of a shard's dead items (all are counted): the
# signal stays far below Temporal's payload limits whatever the shard size.
LISTED_PER_SHARD = 100
MESSAGE_CHARS = 300


class DeadLetterActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=FAIL_SHARD)
    async def fail_shard(self, input: FailShardInput) -> ShardCounts:
        """Mark every unfinished item of a failed shard dead with the shard's reason."""
        counts = await ledger.dead_letters.dead_letter_shard(
            self._ctx.pool,
            job_id=input.job_id,
            shard=input.shard,
            error_class=input.error_class,
            error_message=input.message,
        )
        telemetry.metrics().count_items(
            counts.marked, job_id=input.job_id, model=input.model, status=ItemStatus.DEAD
        )
        return counts

    @activity.defn(name=REPORT_DEAD_LETTERS)
    async def report_dead_letters(self, input: ShardInput) -> int:
        """Send the shard's dead items to the job's DeadLetterWorkflow, starting it if
        this is the first report (signal-with-start); return how many are dead."""
        job_id = input.spec.job_id
        letters = await ledger.dead_letters.dead_items(
            self._ctx.pool, job_id=job_id, shard=input.shard
        )
        report = ShardDeadLetters(shard=input.shard)
        for letter in letters:
            report.by_class[letter.error_class] = report.by_class.get(letter.error_class, 0) + 1
        report.entries = [
            d.model_copy(update={"message": d.message[:MESSAGE_CHARS]})
            for d in letters[:LISTED_PER_SHARD]
        ]
        await dead_letter_client.report_dead_letters(
            activity.client(), input=input, report=report, task_queue=activity.info().task_queue
        )
        return len(letters)

    @activity.defn(name=REQUEUE_DEAD_LETTERS)
    async def requeue_dead_letters(self, input: RequeueInput) -> RequeueResult:
        """Make the selected dead items pending again, for a re-drive."""
        requeued = await ledger.dead_letters.requeue_dead(
            self._ctx.pool,
            job_id=input.job_id,
            item_ids=input.item_ids,
            error_classes=input.error_classes,
        )
        return RequeueResult(requeued=len(requeued.item_ids), shards=requeued.shards)
