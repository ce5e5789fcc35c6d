"""Request keys, weights fingerprints, leads and the result cache, on real Postgres."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

import asyncpg
from hypothesis import given
from hypothesis import strategies as st

from llmbatch import ledger
from llmbatch.contract.spec import SamplingSpec
from llmbatch.dedup import leads, result_cache
from llmbatch.dedup.keys import _dumps, cache_key, request_key, weights_fingerprint
from llmbatch.devstack.tiny_model import build_tiny_model
from llmbatch.ledger.jobs import PlannedShard

MESSAGES = [{"role": "user", "content": "Tell me about ACME."}]


def test_the_request_key_covers_model_messages_sampling_and_constraint() -> None:
    base = request_key(model="m", messages=MESSAGES, sampling=SamplingSpec())
    assert base == request_key(model="m/", messages=MESSAGES, sampling=SamplingSpec())
    others = [
        request_key(model="other", messages=MESSAGES, sampling=SamplingSpec()),
        request_key(
            model="m", messages=[{"role": "user", "content": "x"}], sampling=SamplingSpec()
        ),
        request_key(model="m", messages=MESSAGES, sampling=SamplingSpec(max_tokens=9)),
        request_key(model="m", messages=MESSAGES, sampling=SamplingSpec(choice=["a", "b"])),
        request_key(model="m", messages=MESSAGES, sampling=SamplingSpec(seed=3)),
        # Completions requests: the raw prompt decides, not the (absent) messages.
        request_key(model="m", messages=None, prompt="Once upon", sampling=SamplingSpec()),
        request_key(model="m", messages=None, prompt="Once upon a", sampling=SamplingSpec()),
        # Every further request parameter (n, logprobs, penalties, ...) decides too.
        request_key(model="m", messages=MESSAGES, sampling=SamplingSpec(params={"n": 2})),
        request_key(model="m", messages=MESSAGES, sampling=SamplingSpec(params={"top_k": 5})),
        # A prompt given as token ids, and embedding inputs given as token ids.
        request_key(model="m", messages=None, prompt_token_ids=[1, 2], sampling=SamplingSpec()),
        request_key(model="m", messages=None, sampling=SamplingSpec(), token_ids=[[1, 2]]),
        request_key(model="m", messages=None, sampling=SamplingSpec(), texts=["1 2"]),
    ]
    assert len({base, *others}) == 13
    # A spec without params keys as before there were any (the cache stays valid): the
    # key the previous release computed for this request.
    assert base == "75b6fac696ca217715426c56bb789a8b3e9454d354377f51465b61b6b85ae246"
    assert SamplingSpec().reproducible and SamplingSpec(temperature=0.7, seed=1).reproducible
    assert not SamplingSpec(temperature=0.7).reproducible


# JSON values as messages, prompts and token ids hold them, floats among them: every
# character (control characters, line and paragraph separators, astral ones) in text.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_JSON)
def test_request_keys_hash_the_text_json_writes_whichever_encoder_writes_it(value: object) -> None:
    # Keys (and the result cache behind them) must not change with the faster encoder.
    assert _dumps(value) == json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


@given(st.lists(st.dictionaries(st.text(), st.text() | st.integers(), max_size=3), max_size=3))
def test_chat_messages_key_as_the_json_text_of_the_request(
    messages: list[dict[str, object]],
) -> None:
    # Text-only messages skip the general float check: the key must be the same text's.
    sampling = SamplingSpec()
    text = json.dumps(
        ["m", messages, sampling.model_dump(mode="json", exclude={"params"})],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    expected = hashlib.sha256(text.encode()).hexdigest()
    assert request_key(model="m", messages=messages, sampling=sampling) == expected


async def test_a_model_rebuilt_with_other_weights_misses_the_cache(
    ledger_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    path = tmp_path / "tiny"
    first = weights_fingerprint(str(build_tiny_model(path, seed=0)))
    key = request_key(model=str(path), messages=MESSAGES, sampling=SamplingSpec())
    await result_cache.store(
        ledger_pool,
        model=str(path),
        weights=str(first),
        job_id="cache-job",
        entries=[result_cache.NewEntry(cache_key(key, str(first)), {"text": "hi"}, 3, 1, "r1")],
    )

    rebuilt = weights_fingerprint(str(build_tiny_model(path, seed=1)))  # same path, same name
    assert first is not None and rebuilt is not None and rebuilt != first
    missed = await result_cache.lookup(ledger_pool, cache_keys=[cache_key(key, rebuilt)], uses=[1])
    assert missed == {}
    # The fingerprint is of the files, not of the moment: the old weights hit again.
    again = weights_fingerprint(str(build_tiny_model(path, seed=0)))
    assert again == first
    hit = await result_cache.lookup(ledger_pool, cache_keys=[cache_key(key, again)], uses=[4])
    assert hit[cache_key(key, again)].result == {"text": "hi"}

    (stats,) = [s for s in await result_cache.stats(ledger_pool) if s.model == str(path)]
    assert (stats.entries, stats.hits) == (1, 4)
    assert await result_cache.purge(ledger_pool, older_than=timedelta(days=30)) == 0
    assert await result_cache.purge(ledger_pool, model=str(path)) == 1


async def test_a_lead_is_held_by_its_items_lease_and_taken_over_when_that_dies(
    ledger_pool: asyncpg.Pool,
) -> None:
    job, key = "lead-job", "k" * 64
    items = [ledger.items.NewItem(item_id=i, ordinal=n, prompt_hash=key, source="s") for n, i in
             enumerate(["a1", "b1"])]  # fmt: skip
    await ledger.items.register_items(ledger_pool, job_id=job, shard=0, items=items[:1])
    await ledger.items.register_items(ledger_pool, job_id=job, shard=1, items=items[1:])
    await ledger.items.claim_items(ledger_pool, job_id=job, item_ids=["a1"], lease_owner="A#1")
    await ledger.items.claim_items(ledger_pool, job_id=job, item_ids=["b1"], lease_owner="B#1")

    take = leads.take_leads
    assert await take(
        ledger_pool, job_id=job, leads=[(key, "a1")], lease_owner="A#1", stale_after_s=60
    ) == {key}
    # Shard B finds the lead alive (its item runs under the lead's lease): it waits.
    assert not await take(
        ledger_pool, job_id=job, leads=[(key, "b1")], lease_owner="B#1", stale_after_s=60
    )
    assert (await leads.leads(ledger_pool, job_id=job, request_keys=[key]))[key].result is None

    # A's worker died; its retry claimed the item again under another lease: the lead
    # is free, and exactly one of two shards asking takes it.
    await ledger.items.claim_items(ledger_pool, job_id=job, item_ids=["a1"], lease_owner="A#2")
    assert await take(
        ledger_pool, job_id=job, leads=[(key, "b1")], lease_owner="B#1", stale_after_s=60
    ) == {key}
    assert not await take(
        ledger_pool, job_id=job, leads=[(key, "a1")], lease_owner="A#2", stale_after_s=60
    )
    # A lead whose renewals stopped is taken over too.
    assert await take(
        ledger_pool, job_id=job, leads=[(key, "a1")], lease_owner="A#2", stale_after_s=0
    ) == {key}
    # Once the leader succeeded, followers read its result instead of leading.
    await ledger.items.record_results(
        ledger_pool,
        job_id=job,
        lease_owner="A#2",
        results=[ledger.items.ItemResult("a1", {"text": "t"}, 2, 1, 5.0)],
    )
    assert not await take(
        ledger_pool, job_id=job, leads=[(key, "b1")], lease_owner="B#1", stale_after_s=0
    )
    lead = (await leads.leads(ledger_pool, job_id=job, request_keys=[key]))[key]
    assert (lead.item_id, lead.result, lead.completion_tokens) == ("a1", {"text": "t"}, 1)


async def test_an_attempt_renews_all_its_leads_with_its_shards_row_alone(
    ledger_pool: asyncpg.Pool,
) -> None:
    job, keys = "renew-job", [c * 64 for c in "xyz"]
    planned = [PlannedShard(0, "in.jsonl", 0, 3, None), PlannedShard(1, "in.jsonl", 3, 1, None)]
    await ledger.jobs.record_shards(ledger_pool, job_id=job, shards=planned)
    items = [ledger.items.NewItem(item_id=f"a{n}", ordinal=n, prompt_hash=k, source="s")
             for n, k in enumerate(keys)]  # fmt: skip
    await ledger.items.register_items(ledger_pool, job_id=job, shard=0, items=items)
    await ledger.items.claim_items(
        ledger_pool, job_id=job, item_ids=[i.item_id for i in items], lease_owner="A#1"
    )
    mine = [(k, f"a{n}") for n, k in enumerate(keys)]
    assert await leads.take_leads(
        ledger_pool, job_id=job, leads=mine, lease_owner="A#1", stale_after_s=60
    ) == set(keys)
    # Taken an hour ago and never renewed since: any shard may take them over.
    await ledger_pool.execute(
        "UPDATE dedup_leads SET renewed_at = now() - interval '1 hour' WHERE job_id = $1", job
    )
    progress = await leads.lead_progress(
        ledger_pool, job_id=job, shard=1, request_keys=keys, stale_after_s=60
    )
    assert not progress.worth_waiting

    # Renewed: one row written, the shard's; the leads' own rows are not touched.
    await leads.renew_leads(ledger_pool, job_id=job, shard=0, lease_owner="A#1")
    progress = await leads.lead_progress(
        ledger_pool, job_id=job, shard=1, request_keys=keys, stale_after_s=60
    )
    assert (progress.elsewhere, progress.worth_waiting) == (3, True)
    assert (
        await ledger_pool.fetchval(
            "SELECT count(*) FROM dedup_leads "
            "WHERE job_id = $1 AND renewed_at > now() - interval '1 minute'",
            job,
        )
        == 0
    )
    other = [(k, "b0") for k in keys]
    assert not await leads.take_leads(
        ledger_pool, job_id=job, leads=other, lease_owner="B#1", stale_after_s=60
    )
    # A retry of the shard (its items re-claimed under a new lease, as claim_items
    # does once the first lease lapsed) renews under its own lease: the first
    # attempt's leads are gone, taken over rather than waited for.
    await ledger_pool.execute("UPDATE items SET lease_owner = 'A#2' WHERE job_id = $1", job)
    await leads.renew_leads(ledger_pool, job_id=job, shard=0, lease_owner="A#2")
    assert await leads.take_leads(
        ledger_pool, job_id=job, leads=other, lease_owner="B#1", stale_after_s=60
    ) == set(keys)
