"""What each job's requests did on an endpoint, for operators: requests sent, 429s,
retries, tokens and their cost at the endpoint's prices, the time requests waited
for the rate budget and on the server, and the last error (its fault class and
message). Counted in memory per request, by job and
shard, added to ``endpoint_usage`` once a second and when a generate attempt ends (a
set-based upsert), so the hot path does not touch the database; each shard's figures
reach its workflow in the shard's summary (:func:`llmbatch.ledger.usage.usage`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from llmbatch import telemetry
from llmbatch.contract.messages import RemoteUsage
from llmbatch.contract.states import EndpointFault
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
class LastError:
    """The last failed request's fault class and message, and when (epoch seconds)."""

    fault: EndpointFault
    message: str
    at: float


@dataclass(slots=True)
class EndpointUsage:
    """A job's figures on one endpoint, and its requests' last error there."""

    endpoint: str
    usage: RemoteUsage
    last_error_class: str | None = None
    last_error: str | None = None
    last_error_at: datetime | None = None


class UsageBook:
    def __init__(
        self,
        pool: Database,
        endpoint: Endpoint,
        *,
        on_capped: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._pool = pool
        # Replaced when the endpoint's options change (its prices price what follows).
        self.endpoint = endpoint
        # Told the id of each job this book paused at its max_cost_usd (to pause its
        # workflow too, as `llm-batch pause` does).
        self._on_capped = on_capped
        self._counts: dict[Key, RemoteUsage] = {}
        self._errors: dict[Key, LastError] = {}
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
            endpoint=self.endpoint.name,
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

    def failed(self, key: Key, *, fault: EndpointFault, message: str) -> None:
        """A request failed by the endpoint's doing (kept as the job's last error)."""
        self._of(key)
        self._errors[key] = LastError(fault=fault, message=message, at=time.time())

    def tokens(self, key: Key, *, prompt: int, completion: int) -> None:
        counts = self._of(key)
        counts.prompt_tokens += prompt
        counts.completion_tokens += completion
        cost = self.endpoint.cost_usd(prompt_tokens=prompt, completion_tokens=completion)
        if cost:
            telemetry.metrics().endpoint_cost.add(cost, self._attrs(key))

    def _attrs(self, key: Key) -> dict[str, str]:
        return {telemetry.ENDPOINT: self.endpoint.name, telemetry.JOB_ID: key[0]}

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
        errors, self._errors = self._errors, {}
        if not counts:
            return
        keys = list(counts)
        latest = max(errors.values(), key=lambda e: e.at, default=None)
        try:
            await self._pool.execute(
                """
                WITH totals AS (
                    UPDATE endpoints SET requests_sent = requests_sent + $13::bigint,
                                         retries = retries + $14::bigint,
                                         last_error_class = coalesce($18, last_error_class),
                                         last_error = coalesce($19, last_error),
                                         last_error_at = coalesce(to_timestamp($20::float8),
                                                                  last_error_at)
                     WHERE name = $1
                )
                INSERT INTO endpoint_usage AS u (job_id, shard, endpoint, requests, throttled,
                                                 retries, prompt_tokens, completion_tokens,
                                                 cost_usd, rate_wait_s, server_s,
                                                 last_error_class, last_error, last_error_at)
                SELECT job_id, shard, $1, r, t, x, p, c,
                       p * $11::float8 / 1e6 + c * $12::float8 / 1e6, w, s,
                       ec, em, to_timestamp(ea)
                  FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[], $6::bigint[],
                              $7::bigint[], $8::bigint[], $9::float8[], $10::float8[],
                              $15::text[], $16::text[], $17::float8[])
                       AS v(job_id, shard, r, t, x, p, c, w, s, ec, em, ea)
                ON CONFLICT (job_id, endpoint, shard) DO UPDATE SET
                    last_error_class = coalesce(EXCLUDED.last_error_class, u.last_error_class),
                    last_error = coalesce(EXCLUDED.last_error, u.last_error),
                    last_error_at = coalesce(EXCLUDED.last_error_at, u.last_error_at),
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
                self.endpoint.name,
                [k[0] for k in keys],
                [k[1] for k in keys],
                [counts[k].requests for k in keys],
                [counts[k].throttled for k in keys],
                [counts[k].retries for k in keys],
                [counts[k].prompt_tokens for k in keys],
                [counts[k].completion_tokens for k in keys],
                [counts[k].rate_wait_s for k in keys],
                [counts[k].server_s for k in keys],
                float(self.endpoint.input_price or 0.0),
                float(self.endpoint.output_price or 0.0),
                sum(c.requests for c in counts.values()),
                sum(c.retries for c in counts.values()),
                [_error(errors, k, "fault") for k in keys],
                [_error(errors, k, "message") for k in keys],
                [_error(errors, k, "at") for k in keys],
                None if latest is None else str(latest.fault),
                None if latest is None else latest.message,
                None if latest is None else latest.at,
            )
            capped = await self._pool.fetch(_CAP_SQL, sorted({k[0] for k in keys}))
        except BaseException:
            for key, c in counts.items():  # keep them for the next flush
                self._counts[key] = self._of(key) + c
            for key, e in errors.items():
                self._errors.setdefault(key, e)
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


def _error(errors: dict[Key, LastError], key: Key, field: str) -> object:
    error = errors.get(key)
    if error is None:
        return None
    value = getattr(error, field)
    return str(value) if field == "fault" else value


_LAST_ERROR = ("last_error_class", "last_error", "last_error_at")


async def job_usage(pool: Database, *, job_id: str) -> list[EndpointUsage]:
    """A job's figures on each endpoint it used, and its last error there."""
    rows = await pool.fetch(
        """
        SELECT endpoint, sum(requests) AS requests, sum(throttled) AS throttled,
               sum(retries) AS retries, sum(prompt_tokens) AS prompt_tokens,
               sum(completion_tokens) AS completion_tokens, sum(cost_usd) AS cost_usd,
               sum(rate_wait_s) AS rate_wait_s, sum(server_s) AS server_s,
               (array_agg(last_error_class ORDER BY last_error_at DESC NULLS LAST))[1]
                   AS last_error_class,
               (array_agg(last_error ORDER BY last_error_at DESC NULLS LAST))[1] AS last_error,
               max(last_error_at) AS last_error_at
          FROM endpoint_usage WHERE job_id = $1 GROUP BY endpoint ORDER BY endpoint
        """,
        job_id,
    )
    return [
        EndpointUsage(
            endpoint=r["endpoint"],
            usage=RemoteUsage.model_validate(
                {k: v for k, v in dict(r).items() if k != "endpoint" and k not in _LAST_ERROR}
            ),
            last_error_class=r["last_error_class"],
            last_error=r["last_error"],
            last_error_at=r["last_error_at"],
        )
        for r in rows
    ]
