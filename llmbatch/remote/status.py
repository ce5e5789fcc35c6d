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
    """What ``status`` shows of a job's remote work: why llm-batch paused it, and its
    requests, 429s, retries and cost on each endpoint (nothing for a GPU job)."""
    from llmbatch.ledger.db import create_pool
    from llmbatch.remote.pause import paused_reason
    from llmbatch.remote.usage import job_usage

    pool = await create_pool(dsn, max_size=1)
    try:
        reason = await paused_reason(pool, job_id=job_id)
        usage = await job_usage(pool, job_id=job_id)
    finally:
        await pool.close()
    lines = []
    if reason is not None:
        how = "to go on past it" if reason.startswith("cost cap") else "once fixed"
        lines.append(f"paused by llm-batch: {reason}; {how}: llm-batch resume {job_id}")
    for u in usage:
        per_item = f", ${u.cost_usd / items_done:.6f} per item" if items_done else ""
        lines.append(
            f"endpoint {u.endpoint}: {u.requests} requests, {u.throttled} refused with "
            f"429/503, {u.retries} sent again; {u.prompt_tokens} prompt + "
            f"{u.completion_tokens} completion tokens, ${u.cost_usd:.4f} so far{per_item}"
        )
    return lines
