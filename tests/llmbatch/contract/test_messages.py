"""JobProgress counts the running shards' recorded items once, and their reports in
their place."""

from __future__ import annotations

from llmbatch.contract.messages import JobProgress, ShardCounts, ShardSummary, TokenCounts


def _counts(succeeded: int, dead: int = 0) -> ShardCounts:
    return ShardCounts(
        succeeded=succeeded, dead=dead, tokens=TokenCounts(prompt=10 * succeeded, completion=1)
    )


def test_a_reading_of_running_shards_replaces_the_one_before() -> None:
    p = JobProgress(job_id="j", model="m", shards_running=[0, 1], items_succeeded=5)
    p.take_running_items({0: _counts(3, dead=1)})
    assert (p.items_succeeded, p.items_dead) == (8, 1)
    assert p.tokens == TokenCounts(prompt=30, completion=1)
    # Shard 0 moved on and shard 1 began: counted once each, not added to the first.
    p.take_running_items({0: _counts(4, dead=1), 1: _counts(2)})
    assert (p.items_succeeded, p.items_dead) == (11, 1)
    assert p.tokens == TokenCounts(prompt=60, completion=2)
    # A reading that leaves a shard out keeps what was read of it.
    p.take_running_items({1: _counts(3)})
    assert p.items_succeeded == 12
    assert set(p.running_items) == {0, 1}


def test_a_shard_that_ended_keeps_its_report_over_a_late_reading() -> None:
    p = JobProgress(job_id="j", model="m", shards_running=[0, 1])
    p.take_running_items({0: _counts(3), 1: _counts(1)})
    p.count_shard_report(ShardSummary(shard=0, succeeded=6, dead=1, tokens=TokenCounts()))
    p.shards_running = [1]
    assert (p.items_succeeded, p.items_dead, p.shards_done) == (7, 1, 1)
    # A reading taken before shard 0 ended, applied after: shard 0 is not running.
    p.take_running_items({0: _counts(3), 1: _counts(2)})
    assert (p.items_succeeded, p.items_dead) == (8, 1)
    assert set(p.running_items) == {1}


def test_with_running_items_leaves_the_original_as_it_was() -> None:
    p = JobProgress(job_id="j", model="m", shards_running=[0])
    live = p.with_running_items({0: _counts(2)})
    assert (live.items_succeeded, p.items_succeeded) == (2, 0)
    assert p.running_items == {}
    # What the query answers survives the JSON it travels as (shard numbers as keys).
    assert JobProgress.model_validate_json(live.model_dump_json()) == live
