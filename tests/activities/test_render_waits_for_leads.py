"""A shard whose every request another shard of the job leads is answered at prepare:
its render waits for the leads (heartbeating) and registers its items answered, so
nothing of it is claimed or reaches a worker. On the real ledger and local storage,
in Temporal's activity environment; the test plays the leading shard's generate
attempt with the ledger's own functions (claim, take the leads, record).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.testing import ActivityEnvironment

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.prepare import render_and_register
from llmbatch.config import Settings
from llmbatch.contract.messages import JobLayout, RenderResult, ShardInput
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec, SamplingSpec
from llmbatch.dedup import leads, waits
from llmbatch.formats.records import StagedRequest, StagedRow, load_jsonl
from llmbatch.ledger.jobs import PlannedShard

NAMES = ["ada", "bob", "cy"]


@pytest.fixture
def ctx(ledger_pool: asyncpg.Pool) -> Iterator[ActivityContext]:
    """A CPU worker's activity context on the test ledger (its render pool closed after)."""
    context = ActivityContext(settings=Settings(), pool=ledger_pool)
    try:
        yield context
    finally:
        context.close()


def _input(tmp_path: Path) -> ShardInput:
    """Shard 0 of a job of its own; ``model_copy(update={"shard": n})`` for others."""
    job_id = f"wait-{tmp_path.name[-12:]}"
    spec = JobSpec(
        job_id=job_id,
        inputs=["rows.jsonl"],
        # A prompt no other test sends: only this job leads these requests.
        messages=[ChatMessage(role="user", content=f"{uuid.uuid4().hex} {{{{ name }}}}")],
        model="m",
        sampling=SamplingSpec(max_tokens=4),
        output_uri=f"file://{tmp_path / 'out'}",
        cache=False,
    )
    return ShardInput(
        spec=spec,
        layout=JobLayout(
            job_id=job_id,
            output_root=f"file://{tmp_path / 'out' / job_id}",
            input_format=InputFormat.JSONL,
        ),
        shard=0,
        gpu_task_queue="q",
    )


def _rows(shard: int, names: list[str]) -> list[StagedRow]:
    return [
        StagedRow(item_id=f"s{shard}-{n}", ordinal=shard * 100 + n, source="rows.jsonl",
                  fields={"name": name})
        for n, name in enumerate(names)
    ]  # fmt: skip


async def _prepare(ctx: ActivityContext, input: ShardInput, rows: list[StagedRow],
                   beats: list[Any] | None = None) -> RenderResult:  # fmt: skip
    env = ActivityEnvironment()
    if beats is not None:
        env.on_heartbeat = lambda *details: beats.append(details)
    return await env.run(render_and_register, ctx, input, rows)


async def _lead(
    pool: asyncpg.Pool, ctx: ActivityContext, input: ShardInput, lease: str
) -> list[StagedRequest]:
    """What shard 0's generate attempt does first: claim its items, lead their
    requests (by the keys render staged with them)."""
    todo = list(load_jsonl(await ctx.read(input.layout.shard_requests(0)), StagedRequest))
    job_id = input.spec.job_id
    await ledger.items.claim_items(
        pool, job_id=job_id, item_ids=[r.item_id for r in todo], lease_owner=lease
    )
    taken = await leads.take_leads(
        pool,
        job_id=job_id,
        leads=[(r.key or "", r.item_id) for r in todo],
        lease_owner=lease,
        stale_after_s=60,
    )
    assert taken == {r.key for r in todo}
    return todo


async def _waiting(
    ctx: ActivityContext, input: ShardInput, rows: list[StagedRow]
) -> asyncio.Task[RenderResult]:
    """The shard's prepare, started and seen waiting (it heartbeats, not done)."""
    beats: list[Any] = []
    waiting = asyncio.create_task(_prepare(ctx, input, rows, beats))
    for _ in range(100):
        if beats:
            break
        await asyncio.sleep(0.05)
    assert beats and not waiting.done()
    return waiting


async def _succeed(pool: asyncpg.Pool, job_id: str, lease: str, todo: list[StagedRequest]) -> None:
    """The leading attempt records a result for each of its requests."""
    await ledger.items.record_results(
        pool,
        job_id=job_id,
        lease_owner=lease,
        results=[
            ledger.items.ItemResult(r.item_id, {"text": f"about {r.item_id}"}, 3, 2, 5.0)
            for r in todo
        ],
    )


async def test_a_shard_led_whole_by_another_waits_and_is_answered_without_a_worker(
    ledger_pool: asyncpg.Pool, ctx: ActivityContext, tmp_path: Path
) -> None:
    first = _input(tmp_path)
    second = first.model_copy(update={"shard": 1})
    assert (await _prepare(ctx, first, _rows(0, NAMES))).to_generate == len(NAMES)
    lease = f"{first.spec.job_id}/shard-00000/3#1"
    todo = await _lead(ledger_pool, ctx, first, lease)

    # Shard 1 asks for the same three requests, twice each: it waits.
    waiting = await _waiting(ctx, second, _rows(1, NAMES * 2))
    # Nothing of shard 1 is registered while it waits.
    assert not await ledger_pool.fetchval(
        "SELECT count(*) FROM items WHERE job_id = $1 AND shard = 1", first.spec.job_id
    )

    await _succeed(ledger_pool, first.spec.job_id, lease, todo)
    rendered = await asyncio.wait_for(waiting, 30)
    assert (rendered.to_generate, rendered.already_done) == (0, 2 * len(NAMES))
    rows = await ledger_pool.fetch(
        "SELECT item_id, status, attempt, result_source, shared_with, result, "
        "completion_tokens FROM items WHERE job_id = $1 AND shard = 1 ORDER BY ordinal",
        first.spec.job_id,
    )
    assert [(r["status"], r["attempt"], r["result_source"]) for r in rows] == [
        ("succeeded", 0, "deduplicated")
    ] * (2 * len(NAMES))
    leader = {name: f"s0-{n}" for n, name in enumerate(NAMES)}
    for row, name in zip(rows, NAMES * 2, strict=True):
        assert row["shared_with"] == leader[name]
        assert row["result"] == {"text": f"about {leader[name]}"}
        assert row["completion_tokens"] == 2


async def _plan_three_shards(pool: asyncpg.Pool, input: ShardInput) -> None:
    """The job's plan in the ledger, as plan_job records it: shards 0, 1 and 2."""
    await ledger.jobs.record_shards(
        pool,
        job_id=input.spec.job_id,
        shards=[PlannedShard(n, "rows.jsonl", 0, 0, None) for n in (0, 1, 2)],
    )


async def test_a_shard_registered_after_the_leading_shard_waits_before_its_generate_starts(
    ledger_pool: asyncpg.Pool, ctx: ActivityContext, tmp_path: Path
) -> None:
    first = _input(tmp_path)
    second = first.model_copy(update={"shard": 1})
    await _plan_three_shards(ledger_pool, first)
    await _prepare(ctx, first, _rows(0, NAMES))
    job_id = first.spec.job_id
    # Registering shard 0 led its requests, before any generate attempt of it ran.
    assert await ledger_pool.fetchval(
        "SELECT count(*) FROM dedup_leads WHERE job_id = $1 AND lease_owner = $2",
        job_id,
        leads.REGISTERED_LEAD,
    ) == len(NAMES)

    # Shard 1 asks for the same requests: it waits for shard 0, which has not claimed
    # anything yet, instead of registering them pending for a second write later.
    waiting = await _waiting(ctx, second, _rows(1, NAMES * 2))

    # Shard 0's generate attempt starts: it takes its leads over from registering.
    lease = f"{job_id}/shard-00000/3#1"
    todo = await _lead(ledger_pool, ctx, first, lease)
    await _succeed(ledger_pool, job_id, lease, todo)
    rendered = await asyncio.wait_for(waiting, 30)
    assert (rendered.to_generate, rendered.already_done) == (0, 2 * len(NAMES))
    # The job's last shard leads nothing when it registers: no shard comes after it.
    last = await _prepare(ctx, second.model_copy(update={"shard": 2}), _rows(2, ["eve"]))
    assert last.to_generate == 1
    assert not await ledger_pool.fetchval(
        "SELECT count(*) FROM dedup_leads AS l JOIN items AS i USING (job_id, item_id) "
        "WHERE l.job_id = $1 AND i.shard = 2",
        job_id,
    )
    rows = await ledger_pool.fetch(
        "SELECT status, attempt, result_source FROM items WHERE job_id = $1 AND shard = 1",
        job_id,
    )
    assert {tuple(r) for r in rows} == {("succeeded", 0, "deduplicated")}


async def test_a_shard_rendered_before_an_earlier_shard_registered_waits_for_it(
    ledger_pool: asyncpg.Pool, ctx: ActivityContext, tmp_path: Path
) -> None:
    first = _input(tmp_path)
    second = first.model_copy(update={"shard": 1})
    job_id = first.spec.job_id
    await _plan_three_shards(ledger_pool, first)

    # Shard 1 looks first: nobody leads its requests yet, but shard 0 has not
    # registered, so it waits for that instead of registering them pending.
    waiting = await _waiting(ctx, second, _rows(1, NAMES * 2))
    await _prepare(ctx, first, _rows(0, NAMES))
    # Shard 0 registered and led its requests: shard 1 waits on, for their results.
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert not await ledger_pool.fetchval(
        "SELECT count(*) FROM items WHERE job_id = $1 AND shard = 1", job_id
    )

    lease = f"{job_id}/shard-00000/3#1"
    await _succeed(ledger_pool, job_id, lease, await _lead(ledger_pool, ctx, first, lease))
    rendered = await asyncio.wait_for(waiting, 30)
    assert (rendered.to_generate, rendered.already_done) == (0, 2 * len(NAMES))
    # Written once, answered: never pending.
    rows = await ledger_pool.fetch(
        "SELECT status, attempt, result_source FROM items WHERE job_id = $1 AND shard = 1",
        job_id,
    )
    assert [tuple(r) for r in rows] == [("succeeded", 0, "deduplicated")] * (2 * len(NAMES))


async def test_an_earlier_shard_that_never_registers_is_waited_for_only_so_long(
    ledger_pool: asyncpg.Pool,
    ctx: ActivityContext,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waits, "EARLIER_SHARDS_WAIT_SECONDS", 0.5)
    first = _input(tmp_path)
    await _plan_three_shards(ledger_pool, first)
    # Shard 0 never registers (its prepare step is stuck, say): shard 1 waits for it,
    # heartbeating, as long as the limit, then registers its items for its generate step.
    loop = asyncio.get_running_loop()
    started, beats = loop.time(), list[Any]()
    rendered = await asyncio.wait_for(
        _prepare(ctx, first.model_copy(update={"shard": 1}), _rows(1, NAMES), beats), 10
    )
    assert rendered.to_generate == len(NAMES) and beats
    assert loop.time() - started >= 0.4
    # Shard 0 has no earlier shard: it goes on at once.
    beats.clear()
    rendered = await _prepare(ctx, first, _rows(0, ["fay"]), beats)
    assert rendered.to_generate == 1 and beats == []


async def test_a_lead_registering_took_is_waited_for_only_until_it_is_stale(
    ledger_pool: asyncpg.Pool, ctx: ActivityContext, tmp_path: Path
) -> None:
    first = _input(tmp_path)
    await _plan_three_shards(ledger_pool, first)
    await _prepare(ctx, first, _rows(0, NAMES))
    todo = list(load_jsonl(await ctx.read(first.layout.shard_requests(0)), StagedRequest))
    keys = [r.key or "" for r in todo]

    def progress(shard: int, stale_after_s: float = 60) -> Any:
        return leads.lead_progress(
            ledger_pool,
            job_id=first.spec.job_id,
            shard=shard,
            request_keys=keys,
            stale_after_s=stale_after_s,
        )

    assert (await progress(1)).worth_waiting
    # Never by its own shard, and not once it is older than a lead's renewals may be:
    # then the shard that waited goes on, and its generate step runs the requests.
    assert not (await progress(0)).worth_waiting
    assert not (await progress(1, stale_after_s=0)).worth_waiting
    # Registering leads no attempt: the first generate attempt to ask takes it over,
    # fresh as it is (here shard 1's, whose prepare did not wait).
    assert await leads.take_leads(
        ledger_pool,
        job_id=first.spec.job_id,
        leads=[(k, f"s1-{n}") for n, k in enumerate(keys)],
        lease_owner="B#1",
        stale_after_s=60,
    ) == set(keys)


async def test_a_shard_with_a_request_nobody_leads_does_not_wait(
    ledger_pool: asyncpg.Pool, ctx: ActivityContext, tmp_path: Path
) -> None:
    first = _input(tmp_path)
    second = first.model_copy(update={"shard": 1})
    await _prepare(ctx, first, _rows(0, NAMES))
    await _lead(ledger_pool, ctx, first, f"{first.spec.job_id}/shard-00000/3#1")
    # One request of shard 1 is its own: it must run it, so it goes on at once
    # and registers the others pending (its generate step shares their results).
    beats: list[Any] = []
    rendered = await asyncio.wait_for(_prepare(ctx, second, _rows(1, [*NAMES, "dee"]), beats), 10)
    assert (rendered.to_generate, beats) == (len(NAMES) + 1, [])


async def test_a_lead_counts_as_alive_only_in_another_shard_and_answers_only_pending_items(
    ledger_pool: asyncpg.Pool,
) -> None:
    job, key = f"progress-{uuid.uuid4().hex[:8]}", "k" * 64
    new = [ledger.items.NewItem(item_id=i, ordinal=n, prompt_hash=key, source="s")
           for n, i in enumerate(["a", "b", "c"])]  # fmt: skip
    await ledger.items.register_items(ledger_pool, job_id=job, shard=0, items=new[:1])
    await ledger.items.register_items(ledger_pool, job_id=job, shard=1, items=new[1:])
    await ledger.items.claim_items(ledger_pool, job_id=job, item_ids=["a"], lease_owner="A#1")
    await leads.take_leads(
        ledger_pool, job_id=job, leads=[(key, "a")], lease_owner="A#1", stale_after_s=60
    )

    def progress(shard: int, stale_after_s: float = 60) -> Any:
        return leads.lead_progress(
            ledger_pool, job_id=job, shard=shard, request_keys=[key], stale_after_s=stale_after_s
        )

    assert (await progress(1)).worth_waiting
    # A shard never waits for its own lead, nor for one whose renewals stopped.
    assert not (await progress(0)).worth_waiting
    assert not (await progress(1, stale_after_s=0)).worth_waiting
    # Not answered before the leader succeeded.
    answered, _ = await leads.answer_from_leads(
        ledger_pool, job_id=job, shard=1, items=[("b", key), ("c", key)]
    )
    assert answered == set()

    await ledger.items.record_results(
        ledger_pool,
        job_id=job,
        lease_owner="A#1",
        results=[ledger.items.ItemResult("a", {"text": "t"}, 2, 1, 5.0)],
    )
    assert (await progress(1)).all_answered
    # "c" was claimed meanwhile by its own shard's attempt: that attempt has it.
    await ledger.items.claim_items(ledger_pool, job_id=job, item_ids=["c"], lease_owner="B#1")
    answered, counts = await leads.answer_from_leads(
        ledger_pool, job_id=job, shard=1, items=[("b", key), ("c", key)]
    )
    assert answered == {"b"}
    assert (counts.items, counts.prompt_tokens, counts.completion_tokens) == (1, 2, 1)
    status = dict(
        await ledger_pool.fetch("SELECT item_id, status FROM items WHERE job_id = $1", job)
    )
    assert status == {"a": "succeeded", "b": "succeeded", "c": "running"}
