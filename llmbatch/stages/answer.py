"""Answer: which of a shard's requests are answered already, and by what; it decides,
and the stages after it write.

At prepare (:func:`answer_shard`), before anything is registered: from the job's
succeeded leads and the result cache (:class:`PrepareAnswers`, the keys registering
answers by), after a short wait when other shards lead every request left. In a
generate attempt: identical requests of the shard in one :class:`Group`, what the
result cache holds (:func:`groups_to_run`), and one leader per distinct request across
the job's shards (:class:`Leads`: the others wait for its result, and take the lead
when its attempt died). What is answered comes back as :class:`Answer` decisions,
which the record stage records; nothing here writes an item or calls a later stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from llmbatch.config import Settings
from llmbatch.contract.messages import ShardInput
from llmbatch.contract.spec import EndpointVia, JobSpec, Task
from llmbatch.contract.states import ResultSource
from llmbatch.dedup import leads, result_cache, waits
from llmbatch.dedup.keys import cache_anonymous, cache_key, cache_scope, request_key
from llmbatch.formats.records import StagedRequest
from llmbatch.ledger.served_models import CachePolicy, cache_policy
from llmbatch.stages.context import PrepareContext, StageContext, Step

log = logging.getLogger(__name__)

# Nobody waits longer than this for another shard's result: then it generates its own.
LEAD_WAIT_LIMIT_SECONDS = 600.0


@dataclass(slots=True)
class Group:
    """Claimed items with one request: the first generates (or looks up) the result,
    the others share it. ``key`` is the request key of a reproducible request (None:
    sampled, every item on its own); ``shared`` groups coordinate with other shards."""

    key: str | None
    items: list[StagedRequest]
    shared: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """A group answered with a result generated elsewhere (another shard's lead, or
    the result cache): what each of its items is recorded with."""

    group: Group
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    source: ResultSource
    shared_with: str


@dataclass(frozen=True, slots=True)
class CacheKeys:
    """The result cache's keys of an attempt's requests: of the ``weights`` that
    answer them and of the job's tenant (``scope``, see
    :func:`llmbatch.dedup.keys.cache_scope`). ``anonymous``: a hit of another
    tenant's job is never named."""

    weights: str
    scope: str | None
    anonymous: bool

    @classmethod
    def of(cls, spec: JobSpec, settings: Settings, weights: str) -> CacheKeys:
        scope = cache_scope(spec.tenant, shared=settings.cache_shared_across_tenants)
        return cls(weights, scope, cache_anonymous(spec.tenant, scope))

    def key(self, request: str) -> str:
        """The cache key of the request keyed ``request``."""
        return cache_key(request, self.weights, scope=self.scope)


def group_requests(spec: JobSpec, todo: list[StagedRequest], *, dedup: bool) -> list[Group]:
    """``todo`` by request: identical reproducible requests in one group when ``dedup``,
    every other item in a group of its own."""
    groups: list[Group] = []
    by_key: dict[str, Group] = {}
    for request in todo:
        sampling = request.effective_sampling(spec)
        if request.key is not None and (spec.task is Task.EMBED or sampling.reproducible):
            # Worked out at render, for the ledger's prompt_hash, from the same fields.
            key: str | None = request.key
        elif spec.task is Task.EMBED:
            # An embedding is a function of its texts and options: always reproducible.
            key = request_key(
                model=spec.model,
                messages=None,
                sampling=spec.sampling,
                texts=request.texts or [],
                token_ids=request.token_ids,
                embedding=request.embedding or spec.embed_options,
            )
        elif sampling.reproducible:
            key = request_key(
                model=spec.model,
                messages=request.messages,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                sampling=sampling,
            )
        else:
            key = None
        if key is None or not dedup:
            groups.append(Group(key, [request]))
            continue
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = Group(key, [request], shared=True)
            groups.append(group)
        else:
            group.items.append(request)
    return groups


async def groups_to_run(
    ctx: StageContext,
    spec: JobSpec,
    todo: list[StagedRequest],
    *,
    weights: str | None,
    embed: bool = False,
) -> tuple[list[Group], list[Answer]]:
    """Identical requests of the shard in one group, then those the result cache
    answers (with known ``weights``); return the groups that must be run, and the
    answers."""
    groups = group_requests(spec, todo, dedup=spec.dedup)
    if (
        not embed
        and weights is not None
        and (spec.cache if spec.cache is not None else ctx.settings.cache)
    ):
        return await from_cache(
            ctx, groups, spec=spec, keys=CacheKeys.of(spec, ctx.settings, weights)
        )
    return groups, []


async def from_cache(
    ctx: StageContext, groups: list[Group], *, spec: JobSpec, keys: CacheKeys
) -> tuple[list[Group], list[Answer]]:
    """The groups the result cache does not hold (its entries of ``keys``: the job's
    tenant's only), and the answers of those it does."""
    keyed: dict[str, list[Group]] = {}
    for group in groups:
        if group.key is not None:
            keyed.setdefault(keys.key(group.key), []).append(group)
    hits = await result_cache.lookup(
        ctx.pool,
        cache_keys=list(keyed),
        uses=[sum(len(g.items) for g in gs) for gs in keyed.values()],
    )
    job_id = spec.job_id
    rest: list[Group] = []
    answers: list[Answer] = []
    for group in groups:
        hit = hits.get(keys.key(group.key)) if group.key is not None else None
        if hit is None:
            rest.append(group)
            continue
        if hit.job_id == job_id:  # this job's own result: deduplicated, not cached
            source, shared_with = ResultSource.DEDUPLICATED, hit.item_id
        else:
            # A hit of a cache shared across tenants may be another tenant's: never named.
            source = ResultSource.CACHED
            shared_with = "result_cache" if keys.anonymous else f"{hit.job_id}/{hit.item_id}"
        answers.append(
            Answer(group, hit.result, hit.prompt_tokens, hit.completion_tokens, source, shared_with)
        )
    return rest, answers


@dataclass(frozen=True, slots=True)
class PrepareAnswers:
    """How the prepare step answers a job's requests before they reach a worker: from
    the job's own succeeded leads (``leads``: in-job deduplication across shards), and
    from the result cache with the keys the queue's workers would use (``weights``,
    None: not from the cache; the job's tenant ``scope``). ``anonymous``: an entry of
    another tenant's job is never named."""

    leads: bool
    weights: str | None
    scope: str | None
    anonymous: bool

    def keys(
        self, spec: JobSpec, requests: dict[str, StagedRequest]
    ) -> dict[str, tuple[str | None, str | None]]:
        """(lead key, cache key) of each request that may be answered, by item id:
        those with a request key whose sampling is reproducible (as
        :func:`group_requests` has it)."""
        keys: dict[str, tuple[str | None, str | None]] = {}
        by_request: dict[str, tuple[str | None, str | None]] = {}
        for item_id, request in requests.items():
            if request.key is None or not request.effective_sampling(spec).reproducible:
                continue
            pair = by_request.get(request.key)
            if pair is None:
                pair = by_request[request.key] = (
                    request.key if self.leads else None,
                    None
                    if self.weights is None
                    else cache_key(request.key, self.weights, scope=self.scope),
                )
            keys[item_id] = pair
        return keys


def prepare_answers(spec: JobSpec, policy: CachePolicy | None) -> PrepareAnswers | None:
    """Whether the prepare step answers ``spec``'s requests (None: not), for the queue's
    workers' ``policy`` (:func:`llmbatch.ledger.served_models.cache_policy`).

    Only a generate job answered online (a provider batch looks up its own): from the
    job's succeeded leads when it deduplicates, and from the cache when the queue's
    workers said lately which weights they serve and the cache is on for the job as
    those workers would decide it. The same answers as at generate, written once.
    """
    if spec.task is not Task.GENERATE or spec.via is EndpointVia.BATCH:
        return None
    cache_on = policy is not None and (spec.cache if spec.cache is not None else policy.cache)
    weights = policy.weights if policy is not None and cache_on else None
    if weights is None and not spec.dedup:
        return None
    scope = cache_scope(spec.tenant, shared=policy.shared) if policy is not None else None
    return PrepareAnswers(
        leads=spec.dedup,
        weights=weights,
        scope=scope,
        anonymous=cache_anonymous(spec.tenant, scope),
    )


# The keys of a request that nothing answers.
NO_KEYS: tuple[None, None] = (None, None)


@dataclass(slots=True)
class Answers:
    """What the prepare step decided for a shard's requests: how it answers them
    (``how``, None: it does not), each answerable request's (lead key, cache key) by
    item id (``keys``), and whether it ``waited`` for other shards' leads."""

    how: PrepareAnswers | None
    keys: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    waited: bool = False

    @property
    def leads(self) -> bool:
        """Whether the job's succeeded leads answer its requests."""
        return self.how is not None and self.how.leads

    def lead_keys(self, item_ids: list[str]) -> set[str | None]:
        """The lead keys of ``item_ids`` (None for a request no lead answers)."""
        keys = self.keys
        return {keys.get(i, NO_KEYS)[0] for i in item_ids}


async def answer_shard(
    ctx: PrepareContext, input: ShardInput, requests: dict[str, StagedRequest], *, step: Step
) -> Answers:
    """How a shard's rendered ``requests`` are answered as they are registered.

    Requests other shards lead (from their registering on) are registered once their
    results are in, so that registering answers them (one write an item): when
    other shards lead every request, this waits for them. Earlier shards of the job
    not registered yet are waited for first (they lead what they leave pending).
    """
    spec = input.spec
    how = prepare_answers(spec, await cache_policy(ctx.pool, task_queue=input.gpu_task_queue))
    if how is None:
        return Answers(how)
    answers = Answers(how, how.keys(spec, requests))
    answers.waited = how.leads and await waits.wait_for_leads_of(
        ctx.pool,
        ctx.lead_waits,
        job_id=spec.job_id,
        shard=input.shard,
        lead_keys=answers.lead_keys(list(requests)),
        heartbeat_timeout_s=step.heartbeat_timeout_s,
        beat=step.beat,
        earlier_shards=True,
    )
    return answers


class Leads:
    """A generate attempt's side of in-job deduplication across shards.

    For each distinct request one item of the job leads (``dedup_leads``): its shard
    generates, the others wait and share the result. A lead lives as long as its item
    runs under the leader's lease and the leader renews it with its heartbeats, so
    when the leader's attempt dies the lead is taken over instead of waited for. A
    lead that registering took is taken over by the first attempt that asks.
    """

    def __init__(
        self,
        ctx: StageContext,
        job_id: str,
        lease: str,
        *,
        shard: int,
        heartbeat_timeout_s: float | None,
    ) -> None:
        self._ctx, self._job_id, self._lease = ctx, job_id, lease
        self._shard = shard
        self._stale_after_s = waits.lead_stale_after_s(heartbeat_timeout_s)
        self._leading = False

    async def resolve(
        self, groups: list[Group], *, give_up: bool = False
    ) -> tuple[list[Group], list[Group], list[Answer]]:
        """Lead what nobody (alive) leads of ``groups``; return the groups to generate,
        those still waiting, and the answers of those other shards have results for.
        With ``give_up``, waiting groups are generated too."""
        if not groups:
            return [], [], []
        pool = self._ctx.pool
        current = await leads.leads(
            pool, job_id=self._job_id, request_keys=[g.key for g in groups if g.key]
        )
        open_: list[Group] = []
        answers: list[Answer] = []
        for group in groups:
            lead = current.get(group.key or "")
            if lead is not None and lead.result is not None:
                answers.append(
                    Answer(
                        group,
                        lead.result,
                        lead.prompt_tokens or 0,
                        lead.completion_tokens or 0,
                        ResultSource.DEDUPLICATED,
                        lead.item_id,
                    )
                )
            else:
                open_.append(group)
        taken = await leads.take_leads(
            pool,
            job_id=self._job_id,
            leads=[(g.key or "", g.items[0].item_id) for g in open_],
            lease_owner=self._lease,
            stale_after_s=self._stale_after_s,
        )
        self._leading = self._leading or bool(taken)
        ready = [g for g in open_ if g.key in taken]
        waiting = [g for g in open_ if g.key not in taken]
        if give_up and waiting:
            log.warning(
                "attempt %s: %d requests waited %.0f s for another shard; generating them here",
                self._lease,
                len(waiting),
                LEAD_WAIT_LIMIT_SECONDS,
            )
            ready, waiting = ready + waiting, []
        return ready, waiting, answers

    async def renew(self) -> None:
        """Keep this attempt's leads alive (from the heartbeat loop, which must not die)."""
        if not self._leading:
            return
        try:
            await leads.renew_leads(
                self._ctx.pool, job_id=self._job_id, shard=self._shard, lease_owner=self._lease
            )
        except Exception as exc:  # the ledger is away: others may take over, nothing lost
            log.warning("attempt %s: leads not renewed: %s", self._lease, exc)
