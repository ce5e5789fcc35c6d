"""What ``status`` shows of a job's provider batches: each one's status and counts,
and what the job's tokens cost at the endpoint's batch prices against its online ones."""

from __future__ import annotations

from typing import Any

from llmbatch.ledger.db import Database, create_pool
from llmbatch.provider import book, slots
from llmbatch.provider.settings import get_batch_api
from llmbatch.remote.endpoints import EndpointError, get_endpoint


async def job_report(pool: Database, job_id: str) -> dict[str, Any]:
    """The job's provider batches and their cost, and its shards waiting for a slot
    of the endpoint's ``--batch-max-in-flight``; empty when it has none."""
    batches = await book.job_batches(pool, job_id)
    waiting = [
        {"shard": w.shard, "endpoint": w.endpoint, "in_flight": w.in_flight}
        for w in await slots.job_waiting(pool, job_id)
    ]
    if not batches:
        return {"provider_batches": [], "waiting_for_slot": waiting} if waiting else {}
    prompt = sum(b.prompt_tokens for b in batches)
    completion = sum(b.completion_tokens for b in batches)
    cost: dict[str, float | None] = {"batch_usd": None, "online_usd": None}
    try:
        endpoint = await get_endpoint(pool, batches[0].endpoint)
    except EndpointError:  # removed since: its prices are gone with it
        endpoint = None
    batch_api = await get_batch_api(pool, batches[0].endpoint)
    if batch_api is not None:
        cost["batch_usd"] = batch_api.cost_usd(prompt_tokens=prompt, completion_tokens=completion)
    if endpoint is not None:
        cost["online_usd"] = endpoint.cost_usd(prompt_tokens=prompt, completion_tokens=completion)
    return {
        "provider_batches": [
            {
                "shard": b.shard,
                "submission": b.submission,
                "batch_id": b.batch_id,
                "status": str(b.status),
                "requests": b.requests,
                "completed": b.completed,
                "failed": b.failed,
                "collected": b.collected,
            }
            for b in batches
        ],
        "waiting_for_slot": waiting,
        "provider_tokens": {"prompt": prompt, "completion": completion},
        "provider_cost": cost,
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    if not report:
        return []
    lines = [
        f"provider batch {b['batch_id'] or '(not created)'} (shard {b['shard']}"
        + (f", submission {b['submission'] + 1}" if b["submission"] else "")
        + f"): {b['status']}, {b['completed']} completed, {b['failed']} failed "
        f"of {b['requests']}" + (", recorded" if b["collected"] else "")
        for b in report["provider_batches"]
    ]
    lines += [
        f"shard {w['shard']}: waiting for a provider batch slot (endpoint {w['endpoint']} "
        f"has {w['in_flight']} batches in flight, its --batch-max-in-flight)"
        for w in report["waiting_for_slot"]
    ]
    if "provider_cost" not in report:
        return lines
    cost, tokens = report["provider_cost"], report["provider_tokens"]
    if cost["batch_usd"] is not None:
        online = f" (online: ${cost['online_usd']:.4f})" if cost["online_usd"] is not None else ""
        lines.append(
            f"provider batches: {tokens['prompt']} prompt + {tokens['completion']} completion "
            f"tokens, ${cost['batch_usd']:.4f} at batch prices{online}"
        )
    return lines


async def job_report_at(dsn: str, job_id: str) -> dict[str, Any]:
    """:func:`job_report` on a pool of its own (the CLI's)."""
    pool = await create_pool(dsn, max_size=1)
    try:
        return await job_report(pool, job_id)
    finally:
        await pool.close()
