"""The rate-limit budget every worker of an endpoint shares, through Postgres.

Two token buckets live in the endpoint's row: requests (RPM) and tokens (TPM), each
refilled by elapsed time at its limit times ``send_factor``. A worker takes credits
in small leases (what it sends in about :data:`LEASE_S`) with one set-based
``UPDATE ... RETURNING``, and spends them locally, paced evenly, so the hot path
does not touch the database per request. Credits a worker does not spend within
:data:`CREDIT_TTL_S`, and the difference between each request's estimated and real
token count, go back to the row with its next lease.

A 429 or 503 from the endpoint lowers ``send_factor`` for every worker at once
(multiplicative decrease, at most once per :data:`DECREASE_EVERY_S`) and stores the
endpoint's ``Retry-After`` (capped by the caller) as ``blocked_until``, with why, in
``blocked_reason``; no lease passes it. The factor then grows back by
:data:`INCREASE_PER_S` a second (additive increase). So a 429 storm does not form:
after the first 429s, all workers together send less.

The row is the truth, and it changes under running workers: ``endpoint update``
sets new limits (or none), and it and ``resume`` lift a wait by clearing
``blocked_until`` and counting up the endpoint's generation. Each worker reads the
row every second (:mod:`.watch`) and hands it to :meth:`Budget.observe`: an
unlimited worker starts leasing when a limit appears, a limited one stops when it
goes, and a new generation drops the waits this process holds in memory. Every wait
here sleeps at most :data:`MAX_WAIT_S` before it looks again, so a change reaches a
waiting request within about two seconds.

Tokens may go into debt (a request larger than a second's budget is still granted
when the bucket is not empty, and pays it back by waiting), so any request fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

from llmbatch.ledger.db import Database

# A lease covers about this much sending at the current rate.
LEASE_S = 0.25
# A bucket holds at most this many seconds of its rate (the burst every worker
# together may send after a quiet spell).
BURST_S = 0.5
# Local credits older than this go back to the row (a worker must not hoard them).
CREDIT_TTL_S = 1.0
# AIMD: halve on a 429 (at most once in this many seconds: one storm is one event),
# never below MIN_FACTOR; grow back by INCREASE_PER_S of the limits each second.
DECREASE_FACTOR = 0.5
DECREASE_EVERY_S = 1.0
MIN_FACTOR = 0.05
INCREASE_PER_S = 0.02
# Longest single sleep while waiting for credits (then the row is asked again).
MAX_WAIT_S = 1.0

_LEASE_SQL = """
WITH e AS (
    SELECT name, rpm, tpm, send_factor, blocked_until, req_level, tok_level,
           greatest(extract(epoch FROM clock_timestamp() - refilled_at)::float8, 0) AS elapsed,
           clock_timestamp() AS now_
      FROM endpoints WHERE name = $1 FOR UPDATE
), f AS (
    SELECT e.*, blocked_until > now_ AS blocked,
           -- Additive increase, not while the endpoint asked us to wait.
           CASE WHEN blocked_until > now_ THEN send_factor
                ELSE least(1.0, send_factor + $6::float8 * elapsed) END AS factor
      FROM e
), r AS (
    SELECT f.*, rpm / 60.0 * factor AS req_rate, tpm / 60.0 * factor AS tok_rate FROM f
), lv AS (
    SELECT r.*,
           CASE WHEN rpm IS NULL THEN 0.0 ELSE least(greatest(1.0, req_rate * $7::float8),
                req_level + elapsed * req_rate + $4::float8) END AS req_now,
           CASE WHEN tpm IS NULL THEN 0.0 ELSE least(greatest(1.0, tok_rate * $7::float8),
                tok_level + elapsed * tok_rate + $5::float8) END AS tok_now
      FROM r
), g AS (
    SELECT lv.*,
           CASE WHEN blocked THEN 0
                WHEN rpm IS NULL THEN $2::int
                ELSE least($2::int, floor(greatest(req_now, 0))::int) END AS req_grant0,
           (NOT blocked AND (tpm IS NULL OR tok_now > 0)) AS tok_ok
      FROM lv
), h AS (
    SELECT g.*,
           CASE WHEN tok_ok THEN req_grant0 ELSE 0 END AS req_grant,
           CASE WHEN NOT tok_ok OR ($2::int > 0 AND req_grant0 = 0) THEN 0.0
                ELSE $3::float8 END AS tok_grant
      FROM g
)
UPDATE endpoints en
   SET req_level = h.req_now - CASE WHEN h.rpm IS NULL THEN 0 ELSE h.req_grant END,
       tok_level = h.tok_now - CASE WHEN h.tpm IS NULL THEN 0.0 ELSE h.tok_grant END,
       refilled_at = h.now_,
       send_factor = h.factor
  FROM h
 WHERE en.name = h.name
RETURNING h.req_grant, h.tok_grant, h.req_rate::float8 AS req_rate,
          h.tok_rate::float8 AS tok_rate, h.req_now::float8 AS req_now,
          h.tok_now::float8 AS tok_now, h.factor::float8 AS factor,
          greatest(extract(epoch FROM h.blocked_until - h.now_)::float8, 0) AS blocked_s
"""

_THROTTLED_SQL = """
WITH e AS (
    SELECT name,
           decreased_at < clock_timestamp() - make_interval(secs => $3::float8) AS decrease
      FROM endpoints WHERE name = $1 FOR UPDATE
)
UPDATE endpoints en
   SET send_factor = CASE WHEN e.decrease
                          THEN greatest($4::float8, send_factor * $2::float8)
                          ELSE send_factor END,
       req_level = CASE WHEN e.decrease THEN least(req_level, 0) ELSE req_level END,
       decreased_at = CASE WHEN e.decrease THEN clock_timestamp() ELSE decreased_at END,
       blocked_reason = CASE WHEN clock_timestamp() + make_interval(secs => $5::float8)
                                  > blocked_until THEN $6 ELSE blocked_reason END,
       blocked_until = greatest(blocked_until,
                                clock_timestamp() + make_interval(secs => $5::float8)),
       throttled = throttled + 1
  FROM e
 WHERE en.name = e.name
RETURNING send_factor
"""


@dataclass(slots=True)
class Grant:
    """What one lease gave, and what the row said about waiting."""

    requests: int
    tokens: float
    request_rate: float | None  # requests/s the endpoint is sent at now (None: no RPM)
    token_rate: float | None
    factor: float
    wait_s: float  # how long until a lease can give something again (0: now)


async def lease(
    pool: Database,
    endpoint: str,
    *,
    requests: int,
    tokens: float,
    give_back_requests: float = 0.0,
    give_back_tokens: float = 0.0,
) -> Grant:
    """Take up to ``requests`` request credits and ``tokens`` token credits from the
    endpoint's shared buckets (all or no tokens), giving back unspent ones."""
    row = await pool.fetchrow(
        _LEASE_SQL,
        endpoint,
        requests,
        tokens,
        give_back_requests,
        give_back_tokens,
        INCREASE_PER_S,
        BURST_S,
    )
    if row is None:
        raise LookupError(f"no endpoint named {endpoint}")
    req_rate, tok_rate = row["req_rate"], row["tok_rate"]
    wait = float(row["blocked_s"])
    if not wait:
        if requests and row["req_grant"] == 0 and req_rate:
            wait = max(wait, (1.0 - float(row["req_now"])) / float(req_rate))
        if tokens and row["tok_grant"] == 0 and tok_rate:
            wait = max(wait, (1.0 - float(row["tok_now"])) / float(tok_rate))
    return Grant(
        requests=int(row["req_grant"]),
        tokens=float(row["tok_grant"]),
        request_rate=None if req_rate is None else float(req_rate),
        token_rate=None if tok_rate is None else float(tok_rate),
        factor=float(row["factor"]),
        wait_s=max(wait, 0.0),
    )


async def throttled(
    pool: Database, endpoint: str, *, retry_after_s: float, reason: str | None = None
) -> float:
    """The endpoint said 429/503: every worker slows down and waits ``retry_after_s``
    (``reason`` says why, for status); returns the new send factor."""
    factor = await pool.fetchval(
        _THROTTLED_SQL,
        endpoint,
        DECREASE_FACTOR,
        DECREASE_EVERY_S,
        MIN_FACTOR,
        retry_after_s,
        reason,
    )
    return float(factor) if factor is not None else 1.0


class Budget:
    """One worker process's view of an endpoint's shared budget.

    :meth:`acquire` returns when one request of ``tokens`` estimated tokens may be
    sent: from local credits when there are, else after a lease. Requests are spaced
    evenly at the endpoint's current rate, so a lease is not sent as one burst.
    """

    def __init__(self, pool: Database, endpoint: str, *, rpm: int | None, tpm: int | None) -> None:
        self._pool, self._endpoint = pool, endpoint
        self._requests = 0.0
        self._tokens = 0.0
        self._credit_at = 0.0
        self._give_back_tokens = 0.0
        self._lock = asyncio.Lock()
        self._last_send = 0.0
        self.limited = False
        self.request_rate: float | None = None
        self.token_rate: float | None = None
        self.factor = 1.0
        self._limits(rpm=rpm, tpm=tpm, factor=1.0)
        self.blocked_until = 0.0  # monotonic: a Retry-After seen by this process or the row
        # Set (and replaced) when the row's generation changes: sleepers wake at once.
        self._lifted = asyncio.Event()

    def _limits(self, *, rpm: int | None, tpm: int | None, factor: float) -> None:
        self.limited = rpm is not None or tpm is not None
        self.request_rate = None if rpm is None else rpm / 60.0 * factor
        self.token_rate = None if tpm is None else tpm / 60.0 * factor
        self.factor = factor

    def observe(
        self, *, rpm: int | None, tpm: int | None, factor: float, blocked_s: float, lifted: bool
    ) -> None:
        """The endpoint's row as read now (:mod:`.watch`): its limits, send factor and
        wait. ``lifted``: its generation changed (``endpoint update``, ``resume``), so
        the waits this process holds in memory end with it."""
        self._limits(rpm=rpm, tpm=tpm, factor=factor)
        until = time.monotonic() + blocked_s
        if lifted:
            self.blocked_until = until
            self._last_send = 0.0
            self._lifted.set()
            self._lifted = asyncio.Event()
        else:
            # This process's own 429 may not be in the row yet (or the row unreachable).
            self.blocked_until = max(self.blocked_until, until)

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when the endpoint's waits are lifted meanwhile."""
        if seconds <= 0:
            return
        lifted = self._lifted
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lifted.wait(), seconds)

    def correct(self, *, estimated: float, actual: float) -> None:
        """A response's usage: the difference to its estimate goes back to the row."""
        self._give_back_tokens += estimated - actual

    async def acquire(self, tokens: float) -> None:
        async with self._lock:  # one lease at a time; requests queue here in order
            await self._wait_blocked()
            await self._pace()
            if self.limited:
                await self._take(tokens)
            self._last_send = time.monotonic()

    async def _wait_blocked(self) -> None:
        # A Retry-After may be extended, or lifted, while we sleep: look again after each.
        while (left := self.blocked_until - time.monotonic()) > 0:
            await self.sleep(min(left, MAX_WAIT_S))

    async def _pace(self) -> None:
        # The next request of this process no sooner than 1/rate after the last, at the
        # rate of now (it may change while we wait).
        while (
            self.request_rate
            and (due := self._last_send + 1.0 / self.request_rate - time.monotonic()) > 0
        ):
            await self.sleep(min(due, MAX_WAIT_S))

    async def _take(self, tokens: float) -> None:
        while self.limited:  # the limits may be removed while we wait
            need_tokens = tokens if self.token_rate is not None else 0.0
            now = time.monotonic()
            stale = now - self._credit_at > CREDIT_TTL_S
            if not stale and self._requests >= 1 and self._tokens >= need_tokens:
                self._requests -= 1
                self._tokens -= need_tokens
                return
            give_req, give_tok = (self._requests, self._tokens) if stale else (0.0, 0.0)
            if stale:
                self._requests = self._tokens = 0.0
            want_req = 0 if self._requests >= 1 else self._lease_requests()
            want_tok = (
                0.0
                if self._tokens >= need_tokens
                else max(need_tokens, (self.token_rate or 0.0) * LEASE_S)
            )
            grant = await lease(
                self._pool,
                self._endpoint,
                requests=want_req,
                tokens=want_tok,
                give_back_requests=give_req,
                give_back_tokens=give_tok + self._give_back_tokens,
            )
            self._give_back_tokens = 0.0
            self.request_rate, self.token_rate = grant.request_rate, grant.token_rate
            self.limited = grant.request_rate is not None or grant.token_rate is not None
            self.factor = grant.factor
            self._requests += grant.requests
            self._tokens += grant.tokens
            self._credit_at = time.monotonic()
            if grant.requests < want_req or grant.tokens < want_tok:
                if grant.requests == 0 and grant.tokens == 0:
                    await self.sleep(min(max(grant.wait_s, 0.01), MAX_WAIT_S))

    def _lease_requests(self) -> int:
        if self.request_rate is None:
            return 1
        return max(1, math.ceil(self.request_rate * LEASE_S))

    async def throttled(self, retry_after_s: float, *, reason: str | None = None) -> None:
        """Tell every worker of the endpoint (and this process) to slow down and wait
        ``retry_after_s`` (``reason``: the endpoint's answer and the wait asked)."""
        self.blocked_until = max(self.blocked_until, time.monotonic() + retry_after_s)
        self._requests = 0.0  # credits taken before the 429 must not burst after it
        with contextlib.suppress(Exception):  # the database away: this process still waits
            self.factor = await throttled(
                self._pool, self._endpoint, retry_after_s=retry_after_s, reason=reason
            )
            if self.request_rate is not None:
                self.request_rate *= DECREASE_FACTOR

    async def close(self) -> None:
        """Give back what is left (and the counters), so nothing is lost on a stop."""
        if not self.limited:
            return
        with contextlib.suppress(Exception):
            await lease(
                self._pool,
                self._endpoint,
                requests=0,
                tokens=0.0,
                give_back_requests=self._requests,
                give_back_tokens=self._tokens + self._give_back_tokens,
            )
        self._requests = self._tokens = 0.0
