"""What each job's requests did on an endpoint, for operators: requests sent, 429s,
retries, tokens and their cost at the endpoint's prices, and the time requests waited
for the rate budget. Counted in memory per request, added to ``endpoint_usage`` once
a second (a set-based upsert), so the hot path does not touch the database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from llmbatch.ledger import Database
from llmbatch.remote.endpoints import Endpoint

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    throttled: int = 0
    retries: int = 0
    prompt: int = 0
    completion: int = 0


@dataclass(slots=True)
class EndpointUsage:
    """A job's figures on one endpoint."""

    endpoint: str
    requests: int
    throttled: int
    retries: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float


class UsageBook:
    def __init__(self, pool: Database, endpoint: Endpoint) -> None:
        self._pool, self._endpoint = pool, endpoint
        self._counts: dict[str, _Counts] = {}
        self._task: asyncio.Task[None] | None = None

    def _of(self, job: str) -> _Counts:
        counts = self._counts.get(job)
        if counts is None:
            counts = self._counts[job] = _Counts()
        return counts

    def sent(self, job: str, *, throttled: bool) -> None:
        counts = self._of(job)
        counts.requests += 1
        counts.throttled += int(throttled)

    def retried(self, job: str) -> None:
        self._of(job).retries += 1

    def tokens(self, job: str, *, prompt: int, completion: int) -> None:
        counts = self._of(job)
        counts.prompt += prompt
        counts.completion += completion

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="endpoint usage")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            try:
                await self.flush()
            except Exception as exc:  # the database away: counted again next time
                log.warning("endpoint usage not recorded: %s", exc)

    async def flush(self) -> None:
        counts, self._counts = self._counts, {}
        if not counts:
            return
        jobs = list(counts)
        try:
            await self._pool.execute(
                """
                INSERT INTO endpoint_usage AS u (job_id, endpoint, requests, throttled, retries,
                                                 prompt_tokens, completion_tokens, cost_usd)
                SELECT job_id, $1, r, t, x, p, c, p * $8::float8 / 1e6 + c * $9::float8 / 1e6
                  FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::bigint[],
                              $6::bigint[], $7::bigint[]) AS v(job_id, r, t, x, p, c)
                ON CONFLICT (job_id, endpoint) DO UPDATE SET
                    requests = u.requests + EXCLUDED.requests,
                    throttled = u.throttled + EXCLUDED.throttled,
                    retries = u.retries + EXCLUDED.retries,
                    prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
                    completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
                    cost_usd = u.cost_usd + EXCLUDED.cost_usd,
                    updated_at = now()
                """,
                self._endpoint.name,
                jobs,
                [counts[j].requests for j in jobs],
                [counts[j].throttled for j in jobs],
                [counts[j].retries for j in jobs],
                [counts[j].prompt for j in jobs],
                [counts[j].completion for j in jobs],
                float(self._endpoint.input_price or 0.0),
                float(self._endpoint.output_price or 0.0),
            )
        except BaseException:
            for job, c in counts.items():  # keep them for the next flush
                mine = self._of(job)
                mine.requests += c.requests
                mine.throttled += c.throttled
                mine.retries += c.retries
                mine.prompt += c.prompt
                mine.completion += c.completion
            raise

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()


async def job_usage(pool: Database, *, job_id: str) -> list[EndpointUsage]:
    """A job's figures on each endpoint it used."""
    rows = await pool.fetch(
        """
        SELECT endpoint, requests, throttled, retries, prompt_tokens, completion_tokens,
               cost_usd
          FROM endpoint_usage WHERE job_id = $1 ORDER BY endpoint
        """,
        job_id,
    )
    return [EndpointUsage(**dict(r)) for r in rows]
