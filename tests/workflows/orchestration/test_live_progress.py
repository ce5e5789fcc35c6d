"""Live progress: the job's search attributes and progress take what its running shards
have recorded at the plan's progress_every, and a shard's report replaces that reading."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.client import Client, WorkflowHandle

from llmbatch.contract import search_attributes as sa
from llmbatch.contract.messages import JobProgress, JobSummary, ShardCounts
from llmbatch.contract.names import COUNT_RUNNING_ITEMS, GENERATE, PROGRESS_QUERY
from tests.workflows.orchestration.harness import orchestrate, result_of
from tests.workflows.orchestration.stand_ins import GUARD_S, rows_of, tokens_for

SHARDS = 2


async def _items_done_attribute(handle: WorkflowHandle[object, object], value: int) -> int | None:
    """The job's ItemsDone search attribute once it reads ``value`` (or the guard's end)."""
    found = None
    for _ in range(int(GUARD_S / 0.1)):
        found = (await handle.describe()).typed_search_attributes.get(sa.ITEMS_DONE)
        if found == value:
            break
        await asyncio.sleep(0.1)
    return found


async def test_search_attributes_follow_the_items_running_shards_recorded(
    orchestration_client: Client,
) -> None:
    async with orchestrate(
        orchestration_client, shards=SHARDS, progress_every=timedelta(milliseconds=200)
    ) as run:
        s = run.stand_ins
        s.close_gate(GENERATE, 0)
        s.close_gate(GENERATE, 1)
        handle = await run.start_job(max_concurrent_shards=SHARDS)
        await s.until_called(GENERATE, 0)
        await s.until_called(GENERATE, 1)
        # Shard 0 has recorded 2 items (one of them dead), shard 1 none yet.
        s.recorded = {0: ShardCounts(succeeded=1, dead=1, tokens=tokens_for(1))}
        assert await _items_done_attribute(handle, 2) == 2
        progress = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
        assert (progress.items_succeeded, progress.items_dead) == (1, 1)
        assert progress.tokens == tokens_for(1)
        assert progress.shards_done == 0
        # The reading asks for the running shards only.
        asked = s.called(COUNT_RUNNING_ITEMS)[-1].detail
        assert asked == [0, 1]

        # Shard 0 ends: its report replaces what was read of it (no double count),
        # while shard 1's reading goes on.
        s.recorded = {1: ShardCounts(succeeded=2, dead=0, tokens=tokens_for(2))}
        s.open_gate(GENERATE, 0)
        await result_of(run.shard(0))
        assert await _items_done_attribute(handle, rows_of(0) + 2) == rows_of(0) + 2

        s.open_gate(GENERATE, 1)
        summary: JobSummary = await result_of(handle)

    total = rows_of(0) + rows_of(1)
    assert (summary.items_succeeded, summary.items_dead) == (total, 0)
    assert summary.tokens == tokens_for(total)
    assert summary.running_items == {}
    attributes = (await handle.describe()).typed_search_attributes
    assert attributes.get(sa.ITEMS_DONE) == total


async def test_without_progress_every_the_counts_move_only_when_a_shard_ends(
    orchestration_client: Client,
) -> None:
    """Plans from before progress_every (and operators who set it to 0): no timer, no
    reading, the counts as they were."""
    async with orchestrate(orchestration_client, shards=1) as run:
        s = run.stand_ins
        handle = await run.start_job(max_concurrent_shards=1)
        summary: JobSummary = await result_of(handle)
    assert summary.items_succeeded == rows_of(0)
    assert s.called(COUNT_RUNNING_ITEMS) == []
