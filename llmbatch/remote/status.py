"""What operators see of an endpoint: its shared send rate against its limits, any
wait it imposes and why, its requests' last error, and what every worker sent, had
refused (429) and sent again; and the same of each job's requests."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from llmbatch.ledger.db import Database
from llmbatch.remote.usage import EndpointUsage, job_usage


def _ago(when: datetime | None, now: datetime) -> str:
    seconds = max((now - when).total_seconds(), 0.0) if when is not None else 0.0
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


@dataclass(slots=True)
class EndpointState:
    name: str
    rpm: int | None
    tpm: int | None
    send_factor: float
    blocked_s: float
    # Why it waits: the 429/503's message and the Retry-After it asked (capped).
    blocked_reason: str | None
    requests_sent: int
    throttled: int
    retries: int
    last_error_class: str | None
    last_error: str | None
    last_error_at: datetime | None
    now: datetime

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["now"], data["name"]
        data["last_error_at"] = self.last_error_at.isoformat() if self.last_error_at else None
        return data

    def line(self) -> str:
        rate = (
            f"sending at {self.send_factor:.0%} of its limits"
            + (f" ({self.rpm * self.send_factor:.0f} of {self.rpm} rpm)" if self.rpm else "")
            if self.rpm or self.tpm
            else "no rate limit"
        )
        return (
            f"{rate}{self.wait()}; {self.requests_sent} requests sent, {self.throttled} refused "
            f"with 429/503, {self.retries} sent again"
        )

    def wait(self) -> str:
        """', waiting N s: why (lift it: ...)', or nothing when it does not wait."""
        if self.blocked_s <= 0:
            return ""
        why = f": {self.blocked_reason}" if self.blocked_reason else " (Retry-After)"
        return (
            f", waiting {self.blocked_s:.1f} s{why}; every worker waits "
            f"(lift it now: llm-batch endpoint update {self.name})"
        )

    def error_line(self) -> str | None:
        """The endpoint's last failed request, or None."""
        if self.last_error_class is None:
            return None
        return (
            f"last error ({_ago(self.last_error_at, self.now)}): "
            f"{self.last_error_class}: {self.last_error}"
        )


async def endpoint_state(pool: Database, name: str) -> EndpointState:
    row = await pool.fetchrow(
        """
        SELECT name, rpm, tpm, send_factor, requests_sent, throttled, retries,
               greatest(extract(epoch FROM blocked_until - now())::float8, 0) AS blocked_s,
               blocked_reason, last_error_class, last_error, last_error_at, now() AS now
          FROM endpoints WHERE name = $1
        """,
        name,
    )
    if row is None:
        raise LookupError(f"no endpoint named {name}")
    return EndpointState(**dict(row))


@dataclass(slots=True)
class JobOnEndpoint:
    """A job's figures and last error on one endpoint, and the endpoint's state now
    (None: removed since)."""

    endpoint: str
    used: EndpointUsage | None
    state: EndpointState | None

    def as_dict(self) -> dict[str, Any]:
        used = self.used
        return {
            "endpoint": self.endpoint,
            "usage": used.usage.model_dump(mode="json") if used else None,
            "last_error_class": used.last_error_class if used else None,
            "last_error": used.last_error if used else None,
            "last_error_at": (
                used.last_error_at.isoformat() if used and used.last_error_at else None
            ),
            "now": self.state.as_dict() if self.state else None,
        }

    def lines(self, items_done: int) -> list[str]:
        name, used, state = self.endpoint, self.used, self.state
        lines = []
        if used is not None:
            lines.append(
                used.usage.describe(items_done).replace("endpoint:", f"endpoint {name}:", 1)
                + f"; {used.usage.prompt_tokens} prompt + {used.usage.completion_tokens} "
                "completion tokens"
            )
            if used.last_error_class is not None and state is not None:
                lines.append(
                    f"endpoint {name}: this job's last error "
                    f"({_ago(used.last_error_at, state.now)}): "
                    f"{used.last_error_class}: {used.last_error}"
                )
        if state is not None:
            lines.append(f"endpoint {name} now: {state.line()}")
        return lines


@dataclass(slots=True)
class JobRemoteReport:
    """A job's remote work: why llm-batch paused it, and each endpoint's part."""

    paused_reason: str | None
    endpoints: list[JobOnEndpoint]

    def as_dict(self) -> dict[str, Any]:
        return {
            "paused_reason": self.paused_reason,
            "endpoints": [e.as_dict() for e in self.endpoints],
        }

    def lines(self, job_id: str, *, items_done: int) -> list[str]:
        lines = []
        reason = self.paused_reason
        if reason is not None:
            how = "to go on past it" if reason.startswith("cost cap") else "once fixed"
            lines.append(f"paused by llm-batch: {reason}; {how}: llm-batch resume {job_id}")
        for entry in self.endpoints:
            lines += entry.lines(items_done)
        return lines


async def job_report(pool: Database, job_id: str) -> JobRemoteReport:
    """A job's remote work: on each endpoint it used, and on the one it runs on even
    before it sent anything (a job that waits shows why)."""
    from llmbatch.remote.pause import paused_reason

    reason = await paused_reason(pool, job_id=job_id)
    usage = {u.endpoint: u for u in await job_usage(pool, job_id=job_id)}
    named = await pool.fetchval(
        "SELECT spec->>'remote_endpoint' FROM jobs WHERE job_id = $1", job_id
    )
    names = sorted({*usage, *([str(named)] if named else [])})
    return JobRemoteReport(
        paused_reason=reason,
        endpoints=[
            JobOnEndpoint(name, usage.get(name), await _state_or_none(pool, name)) for name in names
        ],
    )


async def job_lines(dsn: str, job_id: str, *, items_done: int) -> tuple[list[str], dict[str, Any]]:
    """What ``status`` shows of a job's remote work (nothing for a GPU job), and the
    same as data for ``status --json``: why llm-batch paused it; on each endpoint, the
    job's requests, 429s, retries, whether it is rate- or engine-bound, its cost so far
    and per item, and its requests' last error; and the endpoint's send rate against
    its limits and any wait, with why."""
    from llmbatch.ledger.db import create_pool

    pool = await create_pool(dsn, max_size=1)
    try:
        report = await job_report(pool, job_id)
    finally:
        await pool.close()
    return report.lines(job_id, items_done=items_done), report.as_dict()


async def _state_or_none(pool: Database, name: str) -> EndpointState | None:
    try:
        return await endpoint_state(pool, name)
    except LookupError:  # removed since the job ran
        return None
