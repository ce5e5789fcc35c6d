"""Engine usage in the ledger: each generate attempt's requests and GPU time, and a
job's (or shard's) result sources, GPU-seconds and cost, and what its requests did on
remote endpoints (``endpoint_usage``, which :mod:`llmbatch.remote.usage` writes).
"""

from __future__ import annotations

from llmbatch.contract.messages import RemoteUsage, TokenCounts, Usage
from llmbatch.contract.states import (
    ItemStatus,
    ResultSource,
)
from llmbatch.ledger.db import Database


async def record_usage(
    pool: Database,
    *,
    job_id: str,
    shard: int,
    lease_owner: str,
    requests: int,
    busy_s: float,
    gpus: int,
    gpu_hour_price: float | None,
) -> None:
    """Record (or bring up to date) one generate attempt's engine work."""
    await pool.execute(
        """
        INSERT INTO engine_usage
            (job_id, shard, lease_owner, requests, busy_s, gpus, gpu_hour_price)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT (job_id, lease_owner) DO UPDATE
            SET requests = EXCLUDED.requests, busy_s = EXCLUDED.busy_s, updated_at = now()
        """,
        job_id,
        shard,
        lease_owner,
        requests,
        busy_s,
        gpus,
        gpu_hour_price,
    )


async def usage(pool: Database, *, job_id: str, shard: int | None = None) -> Usage:
    """A job's (or one shard's) result sources, engine requests, GPU-seconds and cost,
    as the ledger has them now."""
    row = await pool.fetchrow(
        """
        WITH sources AS (
            SELECT count(*) FILTER (WHERE coalesce(result_source, $3) = $3) AS generated,
                   count(*) FILTER (WHERE result_source = $4) AS deduplicated,
                   count(*) FILTER (WHERE result_source = $5) AS cached,
                   coalesce(sum(prompt_tokens) FILTER (WHERE result_source <> $3), 0)
                       AS reused_prompt,
                   coalesce(sum(completion_tokens) FILTER (WHERE result_source <> $3), 0)
                       AS reused_completion
            FROM items
            WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2) AND status = $6
        ), engine AS (
            SELECT coalesce(sum(requests), 0) AS requests,
                   coalesce(sum(busy_s * gpus), 0) AS gpu_seconds,
                   sum(busy_s * gpus * gpu_hour_price / 3600.0) AS cost
            FROM engine_usage WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2)
        ), remote AS (
            SELECT count(*) AS endpoints, coalesce(sum(requests), 0) AS r_requests,
                   coalesce(sum(throttled), 0) AS r_throttled,
                   coalesce(sum(retries), 0) AS r_retries,
                   coalesce(sum(prompt_tokens), 0) AS r_prompt,
                   coalesce(sum(completion_tokens), 0) AS r_completion,
                   coalesce(sum(cost_usd), 0) AS r_cost,
                   coalesce(sum(rate_wait_s), 0) AS r_rate_wait,
                   coalesce(sum(server_s), 0) AS r_server
            FROM endpoint_usage WHERE job_id = $1 AND ($2::int IS NULL OR shard = $2)
        )
        SELECT * FROM sources, engine, remote
        """,
        job_id,
        shard,
        ResultSource.GENERATED,
        ResultSource.DEDUPLICATED,
        ResultSource.CACHED,
        ItemStatus.SUCCEEDED,
    )
    assert row is not None
    return Usage(
        generated=row["generated"],
        deduplicated=row["deduplicated"],
        cached=row["cached"],
        reused_tokens=TokenCounts(prompt=row["reused_prompt"], completion=row["reused_completion"]),
        engine_requests=row["requests"],
        gpu_seconds=float(row["gpu_seconds"]),
        cost=None if row["cost"] is None else float(row["cost"]),
        remote=(
            RemoteUsage(
                requests=row["r_requests"],
                throttled=row["r_throttled"],
                retries=row["r_retries"],
                prompt_tokens=row["r_prompt"],
                completion_tokens=row["r_completion"],
                cost_usd=float(row["r_cost"]),
                rate_wait_s=float(row["r_rate_wait"]),
                server_s=float(row["r_server"]),
            )
            if row["endpoints"]
            else None
        ),
    )
