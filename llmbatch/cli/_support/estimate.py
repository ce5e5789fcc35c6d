"""``llm-batch submit --estimate``: what a job on an endpoint would cost, before
anything is sent.

The job's rows are read, staged and rendered by the very functions its shards use
(:func:`llmbatch.stages.read.read_staged_rows`,
:func:`llmbatch.stages.render.render_rows`), grouped as its generate steps group them
(in-job deduplication, across all its shards), and the distinct requests the result
cache holds are left out (looked at, not counted as hits). What is left is what the
endpoint would be sent: its prompt tokens counted as the remote worker counts them for
the rate budget (:mod:`llmbatch.remote.tokens`), and at most ``max_tokens`` completion
tokens each, priced at the endpoint's prices. No workflow starts, nothing is written, no
request is sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from llmbatch import ledger, storage
from llmbatch.config import Settings
from llmbatch.contract.spec import InputFormat, JobSpec, Task
from llmbatch.dedup import result_cache
from llmbatch.dedup.keys import cache_key, cache_scope
from llmbatch.engine.requests import GenerationRequest
from llmbatch.formats import ShardPlan, planning
from llmbatch.formats.records import StagedRequest
from llmbatch.remote.endpoints import Endpoint, get_endpoint
from llmbatch.remote.tokens import PromptTokens
from llmbatch.rendering.pool import RenderPool
from llmbatch.stages.answer import group_requests
from llmbatch.stages.read import read_staged_rows
from llmbatch.stages.render import render_rows
from llmbatch.tables import jobs as tables


@dataclass(slots=True)
class Estimate:
    """What a job would send to an endpoint, and what that would cost."""

    endpoint: str
    items: int = 0
    dead: int = 0  # rows that would die before any request (unreadable, template errors)
    deduplicated: int = 0
    cached: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    max_completion_tokens: int = 0
    tokenizer: bool = False  # prompt tokens counted by the model's tokenizer (else chars/4)
    prompt_cost_usd: float = 0.0
    max_cost_usd: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def lines(self) -> list[str]:
        how = "the model's tokenizer" if self.tokenizer else "an estimate of 4 characters a token"
        per = self.max_cost_usd / self.items if self.items else 0.0
        return [
            f"{self.items} items: {self.dead} would die before sending, {self.deduplicated} "
            f"deduplicated, {self.cached} answered by the result cache; "
            f"{self.requests} requests to endpoint {self.endpoint}",
            f"tokens: {self.prompt_tokens} prompt (by {how}), at most "
            f"{self.max_completion_tokens} completion (max_tokens each)",
            f"cost: ${self.prompt_cost_usd:.4f} for the prompts, at most "
            f"${self.max_cost_usd:.4f} in all (${per:.6f} an item) at the endpoint's prices",
        ]


@dataclass(slots=True)
class _Distinct:
    prompt: int
    completion: int
    sends: int  # requests it would take
    items: int  # items it answers


async def estimate(spec: JobSpec, settings: Settings) -> Estimate:
    """Count what ``spec`` (a job on an endpoint) would send, and price it."""
    assert spec.remote_endpoint is not None
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=1)
    renders = RenderPool(settings.render_limits)
    try:
        endpoint = await get_endpoint(pool, spec.remote_endpoint)
        counter = PromptTokens.for_model(spec.model)
        found = Estimate(endpoint=endpoint.name, tokenizer=counter.exact)
        distinct: dict[str, _Distinct] = {}
        fmt, shards = await _plan(spec, settings)
        stores = storage.stores.Stores(settings)
        for shard in shards:
            store = None if fmt is InputFormat.TABLE else stores(shard.uri)
            rows = await read_staged_rows(settings, store, shard, fmt, spec=spec)
            requests, dead = await render_rows(
                renders, spec, fmt, rows, shard=shard.index, overrides={}
            )
            found.items += len(rows)
            found.dead += len(dead)
            _count(spec, found, distinct, list(requests.values()), counter)
        await _leave_out_cached(pool, spec, settings, endpoint, found, distinct)
    finally:
        renders.close()
        await pool.close()
    for d in distinct.values():
        found.requests += d.sends
        found.prompt_tokens += d.prompt * d.sends
        found.max_completion_tokens += d.completion * d.sends
    found.prompt_cost_usd = endpoint.cost_usd(
        prompt_tokens=found.prompt_tokens, completion_tokens=0
    )
    found.max_cost_usd = endpoint.cost_usd(
        prompt_tokens=found.prompt_tokens, completion_tokens=found.max_completion_tokens
    )
    return found


async def _plan(spec: JobSpec, settings: Settings) -> tuple[InputFormat, list[ShardPlan]]:
    """The job's shards, as ``plan_job`` makes them (nothing stored)."""
    if spec.table_input:
        shards = await tables.check_table_job(
            spec, settings, settings.render_limits, create_output=False
        )
        return InputFormat.TABLE, shards or []
    stores = storage.stores.Stores(settings)
    info = await asyncio.to_thread(planning.inspect_inputs, spec, stores, settings.render_limits)
    return info.input_format, await asyncio.to_thread(planning.plan, spec, info, stores)


def _count(
    spec: JobSpec,
    found: Estimate,
    distinct: dict[str, _Distinct],
    requests: list[StagedRequest],
    counter: PromptTokens,
) -> None:
    """Add a shard's requests: one send per group of identical reproducible requests
    of the whole job (in-job deduplication), one per item otherwise."""
    for n, group in enumerate(group_requests(spec, requests, dedup=spec.dedup)):
        first = group.items[0]
        if group.key is not None and group.key in distinct:
            held = distinct[group.key]
            held.items += len(group.items)
            if spec.dedup:
                found.deduplicated += len(group.items)
            else:
                held.sends += len(group.items)
            continue
        if spec.task is Task.EMBED:
            prompt, completion = counter.texts(first.texts or []), 0
        else:
            prompt = counter.request(
                GenerationRequest(
                    request_id=f"estimate:{n}",
                    messages=first.messages,
                    prompt=first.prompt,
                    sampling=first.effective_sampling(spec),
                )
            )
            completion = first.effective_sampling(spec).max_tokens
        sends = 1 if spec.dedup else len(group.items)
        if spec.dedup:
            found.deduplicated += len(group.items) - 1
        # A sampled request has no key: each is sent; keep it under an id of its own.
        key = group.key if group.key is not None else f"#{len(distinct)}"
        distinct[key] = _Distinct(
            prompt=prompt, completion=completion, sends=sends, items=len(group.items)
        )


async def _leave_out_cached(
    pool: ledger.db.Database,
    spec: JobSpec,
    settings: Settings,
    endpoint: Endpoint,
    found: Estimate,
    distinct: dict[str, _Distinct],
) -> None:
    """Drop the distinct requests the result cache would answer (when the job uses it)."""
    if not (spec.cache if spec.cache is not None else settings.cache):
        return
    weights = endpoint.weights(spec.model)
    scope = cache_scope(spec.tenant, shared=settings.cache_shared_across_tenants)
    keyed = {cache_key(k, weights, scope=scope): k for k in distinct if not k.startswith("#")}
    for hit in await result_cache.held(pool, cache_keys=list(keyed)):
        # Every item of a cached request is answered from the cache, none deduplicated.
        answered = distinct.pop(keyed[hit])
        found.cached += answered.items
        found.deduplicated -= answered.items - answered.sends
