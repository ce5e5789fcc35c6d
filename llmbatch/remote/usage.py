"""What each job's requests did on an endpoint, for operators: requests sent, 429s,
retries, tokens and their cost at the endpoint's prices, and the time requests waited
for the rate budget. Counted in memory per request, added to ``endpoint_usage`` once
a second (a set-based upsert), so the hot path does not touch the database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmbatch.ledger.db import Database
from llmbatch.remote.endpoints import Endpoint

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0

# Jobs of this flush whose cost on all endpoints reached their spec's max_cost_usd:
# paused, with the reason, once (a job resumed after it goes on past the cap).
_CAP_SQL = """
WITH cost AS (
    SELECT job_id, sum(cost_usd) AS usd FROM endpoint_usage
     WHERE job_id = ANY($1::text[]) GROUP BY job_id
)
UPDATE jobs j
   SET paused = true,
       paused_reason = format('cost cap reached: $%s spent of max_cost_usd $%s',
                              round(cost.usd::numeric, 4), j.spec->>'max_cost_usd'),
       updated_at = now()
  FROM cost
 WHERE j.job_id = cost.job_id
   AND j.spec->>'max_cost_usd' IS NOT NULL
   AND cost.usd >= (j.spec->>'max_cost_usd')::float8
   AND NOT j.paused
   AND coalesce(j.paused_reason, '') NOT LIKE 'cost cap reached%'
RETURNING j.job_id, j.paused_reason
"""


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
    def __init__(
        self,
        pool: Database,
        endpoint: Endpoint,
        *,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._pool, self._endpoint = pool, endpoint
        # Told the id of each job this book paused at its max_cost_usd (to pause its
        # workflow too, as `llm-batch pause` does).
        self._on_capped = on_capped
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
                WITH totals AS (
                    UPDATE endpoints SET requests_sent = requests_sent + $10::bigint,
                                         retries = retries + $11::bigint
                     WHERE name = $1
                )
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
                sum(c.requests for c in counts.values()),
                sum(c.retries for c in counts.values()),
            )
            capped = await self._pool.fetch(_CAP_SQL, jobs)
        except BaseException:
            for job, c in counts.items():  # keep them for the next flush
                mine = self._of(job)
                mine.requests += c.requests
                mine.throttled += c.throttled
                mine.retries += c.retries
                mine.prompt += c.prompt
                mine.completion += c.completion
            raise
        for row in capped:
            log.warning("job %s paused: %s", row["job_id"], row["paused_reason"])
            if self._on_capped is not None:
                await self._on_capped(row["job_id"])

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
