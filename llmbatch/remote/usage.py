"""What each job's requests did on an endpoint, for operators: requests sent, 429s,
retries, tokens and their cost at the endpoint's prices, and the time requests waited
for the rate budget and on the server. Counted in memory per request, by job and
shard, added to ``endpoint_usage`` once a second and when a generate attempt ends (a
set-based upsert), so the hot path does not touch the database; each shard's figures
reach its workflow in the shard's summary (:func:`llmbatch.ledger.usage.usage`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmbatch import telemetry
from llmbatch.contract.messages import RemoteUsage
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


# A job and its shard (-1: not a shard's request).
Key = tuple[str, int]


@dataclass(slots=True)
class EndpointUsage:
    """A job's figures on one endpoint."""

    endpoint: str
    usage: RemoteUsage


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
        self._counts: dict[Key, RemoteUsage] = {}
        self._task: asyncio.Task[None] | None = None

    def _of(self, key: Key) -> RemoteUsage:
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = RemoteUsage()
        return counts

    def sent(self, key: Key, *, throttled: bool, rate_wait_s: float, server_s: float) -> None:
        """One request answered: ``rate_wait_s`` it waited for the budget first (or
        backed off after a 429), ``server_s`` it took at the endpoint."""
        counts = self._of(key)
        counts.requests += 1
        counts.throttled += int(throttled)
        counts.rate_wait_s += rate_wait_s
        counts.server_s += server_s
        telemetry.metrics().count_endpoint_request(
            endpoint=self._endpoint.name,
            job_id=key[0],
            throttled=throttled,
            rate_wait_s=rate_wait_s,
            server_s=server_s,
        )

    def retried(self, key: Key, *, backoff_s: float, throttled: bool) -> None:
        """A request sent again after ``backoff_s``; after a 429 that wait is the rate's."""
        counts = self._of(key)
        counts.retries += 1
        if throttled:
            counts.rate_wait_s += backoff_s
            telemetry.metrics().endpoint_wait.add(
                backoff_s, {**self._attrs(key), "llmbatch.waited_for": "rate"}
            )
        telemetry.metrics().endpoint_retries.add(1, self._attrs(key))

    def tokens(self, key: Key, *, prompt: int, completion: int) -> None:
        counts = self._of(key)
        counts.prompt_tokens += prompt
        counts.completion_tokens += completion
        cost = self._endpoint.cost_usd(prompt_tokens=prompt, completion_tokens=completion)
        if cost:
            telemetry.metrics().endpoint_cost.add(cost, self._attrs(key))

    def _attrs(self, key: Key) -> dict[str, str]:
        return {telemetry.ENDPOINT: self._endpoint.name, telemetry.JOB_ID: key[0]}

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
        keys = list(counts)
        try:
            await self._pool.execute(
                """
                WITH totals AS (
                    UPDATE endpoints SET requests_sent = requests_sent + $13::bigint,
                                         retries = retries + $14::bigint
                     WHERE name = $1
                )
                INSERT INTO endpoint_usage AS u (job_id, shard, endpoint, requests, throttled,
                                                 retries, prompt_tokens, completion_tokens,
                                                 cost_usd, rate_wait_s, server_s)
                SELECT job_id, shard, $1, r, t, x, p, c,
                       p * $11::float8 / 1e6 + c * $12::float8 / 1e6, w, s
                  FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[], $6::bigint[],
                              $7::bigint[], $8::bigint[], $9::float8[], $10::float8[])
                       AS v(job_id, shard, r, t, x, p, c, w, s)
                ON CONFLICT (job_id, endpoint, shard) DO UPDATE SET
                    requests = u.requests + EXCLUDED.requests,
                    throttled = u.throttled + EXCLUDED.throttled,
                    retries = u.retries + EXCLUDED.retries,
                    prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
                    completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
                    cost_usd = u.cost_usd + EXCLUDED.cost_usd,
                    rate_wait_s = u.rate_wait_s + EXCLUDED.rate_wait_s,
                    server_s = u.server_s + EXCLUDED.server_s,
                    updated_at = now()
                """,
                self._endpoint.name,
                [k[0] for k in keys],
                [k[1] for k in keys],
                [counts[k].requests for k in keys],
                [counts[k].throttled for k in keys],
                [counts[k].retries for k in keys],
                [counts[k].prompt_tokens for k in keys],
                [counts[k].completion_tokens for k in keys],
                [counts[k].rate_wait_s for k in keys],
                [counts[k].server_s for k in keys],
                float(self._endpoint.input_price or 0.0),
                float(self._endpoint.output_price or 0.0),
                sum(c.requests for c in counts.values()),
                sum(c.retries for c in counts.values()),
            )
            capped = await self._pool.fetch(_CAP_SQL, sorted({k[0] for k in keys}))
        except BaseException:
            for key, c in counts.items():  # keep them for the next flush
                self._counts[key] = self._of(key) + c
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
        SELECT endpoint, sum(requests) AS requests, sum(throttled) AS throttled,
               sum(retries) AS retries, sum(prompt_tokens) AS prompt_tokens,
               sum(completion_tokens) AS completion_tokens, sum(cost_usd) AS cost_usd,
               sum(rate_wait_s) AS rate_wait_s, sum(server_s) AS server_s
          FROM endpoint_usage WHERE job_id = $1 GROUP BY endpoint ORDER BY endpoint
        """,
        job_id,
    )
    return [
        EndpointUsage(
            endpoint=r["endpoint"],
            usage=RemoteUsage.model_validate({k: v for k, v in dict(r).items() if k != "endpoint"}),
        )
        for r in rows
    ]
