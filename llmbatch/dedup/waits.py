"""Waiting for other shards' leads: how a prepare step waits, before or after
registering its items, while other shards of the job lead every request it has left,
and how long a lead counts as alive without a renewal.

A prepare step waits so that its shard is answered there: otherwise its generate
step claims every item, waits for the leads and records each result (two more writes
an item), a step on the engine's queue for a shard that never needs the engine. The
wait polls :func:`llmbatch.dedup.leads.lead_progress`, heartbeating the step, and is
short: it holds a CPU worker's activity slot, and a paused job's leads never finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

from llmbatch.dedup import leads
from llmbatch.ledger import jobs
from llmbatch.ledger.db import Database

log = logging.getLogger(__name__)

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


async def wait_for_leads_of(
    pool: Database,
    slots: WaitSlots,
    *,
    job_id: str,
    shard: int,
    lead_keys: Collection[str | None],
    heartbeat_timeout_s: float | None,
    beat: Callable[[], None],
    earlier_shards: bool = False,
) -> bool:
    """Wait while other shards lead every request of a shard's items (their
    ``lead_keys``) with :func:`wait_for_leads`, in one of the worker's ``slots``, for a
    step started with ``heartbeat_timeout_s``; whether they did."""
    # A request without a lead key (sampled) runs here anyway: nothing to wait for.
    # Nor when enough steps of this worker wait already.
    if not lead_keys or None in lead_keys or not slots.take():
        return False
    try:
        return await wait_for_leads(
            pool,
            job_id=job_id,
            shard=shard,
            request_keys=sorted(k for k in lead_keys if k is not None),
            stale_after_s=lead_stale_after_s(heartbeat_timeout_s),
            beat=beat,
            earlier_shards=earlier_shards,
        )
    finally:
        slots.give_back()


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

    The wait stops when a request has no live lead elsewhere (the shard must run it,
    or take the lead over) or after ``limit_s``; the generate step has what is left.
    With ``earlier_shards``, a request nobody leads first waits (up to
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
