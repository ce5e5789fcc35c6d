"""How a generate attempt deduplicates: identical requests of a shard in one group,
answers from the result cache, and one leader per distinct request across the job's
shards (the others wait for its result, and take the lead when its attempt died).
And how a prepare step answers before that: from the job's succeeded leads and the
cache (:func:`render_answers`), and by waiting for other shards' leads when they lead
every request left (:func:`wait_for_leads`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmbatch.contract.spec import EndpointVia, JobSpec, Task
from llmbatch.contract.states import ResultSource
from llmbatch.dedup import leads, result_cache
from llmbatch.dedup.keys import cache_anonymous, cache_key, cache_scope, request_key
from llmbatch.formats.records import StagedRequest
from llmbatch.ledger import jobs
from llmbatch.ledger.db import Database
from llmbatch.ledger.served_models import CachePolicy

if TYPE_CHECKING:
    # Typing only: the recorder imports this module (its groups) at run time.
    from llmbatch.generation.recorder import Recorder, RecordingContext

log = logging.getLogger(__name__)

# Nobody waits longer than this for another shard's result: then it generates its own.
LEAD_WAIT_LIMIT_SECONDS = 600.0

# A lead not renewed for this many heartbeat timeouts is taken over (its attempt is
# gone without its items being claimed again, e.g. no worker took the retry yet).
LEAD_STALE_TIMEOUTS = 2.0


def lead_stale_after_s(heartbeat_timeout_s: float | None) -> float:
    """Seconds without a renewal after which a lead is gone, for steps started with
    ``heartbeat_timeout_s`` (30 s when they have none)."""
    return (heartbeat_timeout_s or 30.0) * LEAD_STALE_TIMEOUTS


# A prepare step waits this long at most for other shards' leads, then hands what is
# left to its generate step, which waits on (and takes over a lead that died). Short:
# the wait holds a CPU worker's activity slot, and a paused job's leads never finish.
PREPARE_WAIT_LIMIT_SECONDS = 60.0
# Polls of a prepare step's wait: the first soon (a leader's shard is often about to
# record), then less often.
PREPARE_POLL_FIRST_SECONDS = 0.05
PREPARE_POLL_MAX_SECONDS = 0.1
# A shard that finds a request nobody leads yet waits this long at most for the job's
# earlier shards to register (registering leads their pending requests): they are
# smaller and start with it, so they are usually a fraction of a second behind, and
# a shard that looked before they registered would otherwise register its items
# pending and be answered by a second write of each.
EARLIER_SHARDS_WAIT_SECONDS = 5.0
# Prepare steps of one worker that wait at once (:class:`WaitSlots`): a sixth of the
# activity slots Temporal gives a worker by default (100).
PREPARE_WAITS_PER_WORKER = 16


@dataclass(slots=True)
class Group:
    """Claimed items with one request: the first generates (or looks up) the result,
    the others share it. ``key`` is the request key of a reproducible request (None:
    sampled, every item on its own); ``shared`` groups coordinate with other shards."""

    key: str | None
    items: list[StagedRequest]
    shared: bool = False


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
    ctx: RecordingContext,
    spec: JobSpec,
    todo: list[StagedRequest],
    recorder: Recorder,
    *,
    weights: str | None,
    embed: bool = False,
) -> list[Group]:
    """Identical requests of the shard in one group, then what the result cache
    answers recorded as such (with known ``weights``); what is left must be run."""
    groups = group_requests(spec, todo, dedup=spec.dedup)
    if (
        not embed
        and weights is not None
        and (spec.cache if spec.cache is not None else ctx.settings.cache)
    ):
        groups = await from_cache(ctx, recorder, groups)
    return groups


async def from_cache(ctx: RecordingContext, recorder: Recorder, groups: list[Group]) -> list[Group]:
    """Answer the groups the result cache holds (the recorder's tenant's entries only,
    see :func:`llmbatch.dedup.keys.cache_scope`); return the others."""
    keyed: dict[str, list[Group]] = {}
    for group in groups:
        if group.key is not None:
            keyed.setdefault(recorder.cache_key(group.key), []).append(group)
    hits = await result_cache.lookup(
        ctx.pool,
        cache_keys=list(keyed),
        uses=[sum(len(g.items) for g in gs) for gs in keyed.values()],
    )
    job_id = recorder.job_id
    # A hit of a cache shared across tenants may be another tenant's: never named.
    anonymous = cache_anonymous(recorder.tenant, recorder.scope)
    rest: list[Group] = []
    for group in groups:
        hit = hits.get(recorder.cache_key(group.key)) if group.key is not None else None
        if hit is None:
            rest.append(group)
        elif hit.job_id == job_id:  # this job's own result: deduplicated, not cached
            recorder.share(group, hit, source=ResultSource.DEDUPLICATED, shared_with=hit.item_id)
        else:
            origin = "result_cache" if anonymous else f"{hit.job_id}/{hit.item_id}"
            recorder.share(group, hit, source=ResultSource.CACHED, shared_with=origin)
    return rest


@dataclass(frozen=True, slots=True)
class RenderAnswers:
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


def render_answers(spec: JobSpec, policy: CachePolicy | None) -> RenderAnswers | None:
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
    return RenderAnswers(
        leads=spec.dedup,
        weights=weights,
        scope=scope,
        anonymous=cache_anonymous(spec.tenant, scope),
    )


class Leads:
    """The shard's side of in-job deduplication across shards.

    For each distinct request one item of the job leads (``dedup_leads``): its shard
    generates, the others wait and share the result. A lead lives as long as its item
    runs under the leader's lease and the leader renews it with its heartbeats, so
    when the leader's attempt dies the lead is taken over instead of waited for. A
    lead that registering took is taken over by the first attempt that asks.
    """

    def __init__(
        self,
        ctx: RecordingContext,
        job_id: str,
        lease: str,
        recorder: Recorder,
        *,
        shard: int,
        heartbeat_timeout_s: float | None,
    ) -> None:
        self._ctx, self._job_id, self._lease, self._recorder = ctx, job_id, lease, recorder
        self._shard = shard
        self._stale_after_s = lead_stale_after_s(heartbeat_timeout_s)
        self._leading = False

    async def resolve(
        self, groups: list[Group], *, give_up: bool = False
    ) -> tuple[list[Group], list[Group]]:
        """Share the results other shards have for ``groups``, lead what nobody (alive)
        leads; return the groups to generate and those still waiting. With
        ``give_up``, waiting groups are generated too."""
        if not groups:
            return [], []
        pool = self._ctx.pool
        current = await leads.leads(
            pool, job_id=self._job_id, request_keys=[g.key for g in groups if g.key]
        )
        open_: list[Group] = []
        for group in groups:
            lead = current.get(group.key or "")
            if lead is not None and lead.result is not None:
                self._recorder.share(
                    group, lead, source=ResultSource.DEDUPLICATED, shared_with=lead.item_id
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
        return ready, waiting

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


class WaitSlots:
    """How many prepare steps of one worker may wait for leads at once: beyond that a
    shard goes on to its generate step at once, so waits never fill the worker's
    activity slots and stall other jobs' CPU steps."""

    def __init__(self, limit: int) -> None:
        self._free = limit

    def take(self) -> bool:
        if self._free <= 0:
            return False
        self._free -= 1
        return True

    def give_back(self) -> None:
        self._free += 1


async def wait_for_leads(
    pool: Database,
    *,
    job_id: str,
    shard: int,
    request_keys: Sequence[str],
    stale_after_s: float,
    beat: Callable[[], None],
    limit_s: float = PREPARE_WAIT_LIMIT_SECONDS,
    earlier_shards: bool = False,
) -> bool:
    """Wait while other shards lead every one of a shard's requests (``request_keys``,
    distinct) and have not all succeeded; return whether they led (or had answered)
    them all to begin with, False when nothing was worth waiting for.

    A prepare step waits so that its shard is answered there: otherwise its generate
    step claims every item, waits for the leads and records each result (two more
    writes an item), a step on the engine's queue for a shard that never needs the
    engine. The wait stops when a request has no live lead elsewhere (the shard must
    run it, or take the lead over) or after ``limit_s``; the generate step has what
    is left. With ``earlier_shards``, a request nobody leads first waits (up to
    :data:`EARLIER_SHARDS_WAIT_SECONDS`) for the job's earlier shards to register,
    and is looked at again. ``beat`` heartbeats the step while it waits.
    """
    started = time.monotonic()

    async def look() -> leads.LeadProgress:
        return await leads.lead_progress(
            pool, job_id=job_id, shard=shard, request_keys=request_keys, stale_after_s=stale_after_s
        )

    progress = await look()
    if not (progress.worth_waiting or progress.all_answered):
        if not (earlier_shards and await _earlier_shards_registered(pool, job_id, shard, beat)):
            return False
        progress = await look()
        if not (progress.worth_waiting or progress.all_answered):
            return False

    async def answered() -> bool:
        nonlocal progress
        progress = await look()
        return not progress.worth_waiting

    polls = 0
    if progress.worth_waiting:
        polls = await _poll_until(answered, beat=beat, deadline=started + limit_s)
    if polls:
        log.info(
            "shard %d of %s waited %.2f s for other shards' leads: %d of %d answered",
            shard,
            job_id,
            time.monotonic() - started,
            progress.answered,
            progress.keys,
        )
    return True


async def _earlier_shards_registered(
    pool: Database, job_id: str, shard: int, beat: Callable[[], None]
) -> bool:
    """Wait (heartbeating) until the job's planned shards before ``shard`` have all
    registered, or :data:`EARLIER_SHARDS_WAIT_SECONDS`; whether any had not when
    asked (so their leads are worth another look)."""

    async def registered() -> bool:
        return not await jobs.shards_unregistered(pool, job_id=job_id, before=shard)

    if await registered():
        return False
    started = time.monotonic()
    await _poll_until(registered, beat=beat, deadline=started + EARLIER_SHARDS_WAIT_SECONDS)
    log.info(
        "shard %d of %s waited %.2f s for the job's earlier shards to register",
        shard,
        job_id,
        time.monotonic() - started,
    )
    return True


async def _poll_until(
    done: Callable[[], Awaitable[bool]], *, beat: Callable[[], None], deadline: float
) -> int:
    """Ask ``done`` after PREPARE_POLL_FIRST_SECONDS, then at most every
    PREPARE_POLL_MAX_SECONDS, heartbeating before each pause, until it says so or the
    next pause would pass ``deadline`` (monotonic); return how many times it asked."""
    pause = PREPARE_POLL_FIRST_SECONDS
    polls = 0
    while time.monotonic() + pause <= deadline:
        polls += 1
        beat()
        await asyncio.sleep(pause)
        pause = min(pause * 2, PREPARE_POLL_MAX_SECONDS)
        if await done():
            break
    return polls
