"""What operators see of an endpoint: its shared send rate against its limits and
what every worker sent, had refused (429) and sent again."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmbatch.ledger.db import Database


@dataclass(slots=True)
class EndpointState:
    rpm: int | None
    tpm: int | None
    send_factor: float
    blocked_s: float
    requests_sent: int
    throttled: int
    retries: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        rate = (
            f"sending at {self.send_factor:.0%} of its limits"
            + (f" ({self.rpm * self.send_factor:.0f} of {self.rpm} rpm)" if self.rpm else "")
            if self.rpm or self.tpm
            else "no rate limit"
        )
        blocked = f", waiting {self.blocked_s:.1f} s (Retry-After)" if self.blocked_s > 0 else ""
        return (
            f"{rate}{blocked}; {self.requests_sent} requests sent, {self.throttled} refused "
            f"with 429/503, {self.retries} sent again"
        )


async def endpoint_state(pool: Database, name: str) -> EndpointState:
    row = await pool.fetchrow(
        """
        SELECT rpm, tpm, send_factor, requests_sent, throttled, retries,
               greatest(extract(epoch FROM blocked_until - now())::float8, 0) AS blocked_s
          FROM endpoints WHERE name = $1
        """,
        name,
    )
    if row is None:
        raise LookupError(f"no endpoint named {name}")
    return EndpointState(**dict(row))


async def job_lines(dsn: str, job_id: str, *, items_done: int) -> list[str]:
    """What ``status`` shows of a job's remote work: why llm-batch paused it; on each
    endpoint, the job's requests, 429s, retries, whether it is rate- or engine-bound,
    its cost so far and per item; and the endpoint's send rate against its limits
    (nothing for a GPU job)."""
    from llmbatch.ledger.db import create_pool
    from llmbatch.remote.pause import paused_reason
    from llmbatch.remote.usage import job_usage

    pool = await create_pool(dsn, max_size=1)
    try:
        reason = await paused_reason(pool, job_id=job_id)
        usage = await job_usage(pool, job_id=job_id)
        states = {u.endpoint: await _state_or_none(pool, u.endpoint) for u in usage}
    finally:
        await pool.close()
    lines = []
    if reason is not None:
        how = "to go on past it" if reason.startswith("cost cap") else "once fixed"
        lines.append(f"paused by llm-batch: {reason}; {how}: llm-batch resume {job_id}")
    for u in usage:
        lines.append(
            u.usage.describe(items_done).replace("endpoint:", f"endpoint {u.endpoint}:", 1)
            + f"; {u.usage.prompt_tokens} prompt + {u.usage.completion_tokens} completion tokens"
        )
        state = states[u.endpoint]
        if state is not None:
            lines.append(f"endpoint {u.endpoint} now: {state.line()}")
    return lines


async def _state_or_none(pool: Database, name: str) -> EndpointState | None:
    try:
        return await endpoint_state(pool, name)
    except LookupError:  # removed since the job ran
        return None
