"""The ``provider_batches`` table: every provider batch llm-batch creates, recorded
before it is waited for (see migrations/0010_provider_batches.sql)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime

from llmbatch.contract.provider import NOTHING_TO_SEND, PREPARING
from llmbatch.contract.states import BatchStatus
from llmbatch.ledger.db import Database


def token_of(job_id: str, shard: int, submission: int, *, redrive: int = 0) -> str:
    """The batch's token: the same for every attempt at the same submission (of the
    job's own run of the shard, or of its re-drive number ``redrive``)."""
    run = f"{shard}" if redrive == 0 else f"{shard}\x1fredrive-{redrive}"
    return hashlib.sha256(f"{job_id}\x1f{run}\x1f{submission}".encode()).hexdigest()[:32]


def lease_of(job_id: str, shard: int, submission: int, *, redrive: int = 0) -> str:
    """The ledger lease a submission's items are claimed under."""
    run = "" if redrive == 0 else f"redrive-{redrive}-"
    return f"{job_id}/shard-{shard}/provider-batch-{run}{submission}"


@dataclass(slots=True)
class ProviderBatchRow:
    token: str
    job_id: str
    shard: int
    submission: int
    endpoint: str
    lease_owner: str
    input_file_id: str | None
    url: str | None
    batch_id: str | None
    status: str  # a BatchStatus, or PREPARING / NOTHING_TO_SEND
    requests: int
    completed: int
    failed: int
    followers: dict[str, list[str]]
    collected: bool
    prompt_tokens: int
    completion_tokens: int
    created_at: datetime


_COLUMNS = (
    "token, job_id, shard, submission, endpoint, lease_owner, input_file_id, url, batch_id, "
    "status, "
    "requests, completed, failed, followers, collected, prompt_tokens, completion_tokens, "
    "created_at"
)


def _row(record: object) -> ProviderBatchRow:
    values = dict(record)  # type: ignore[call-overload]
    values["followers"] = json.loads(values["followers"])
    return ProviderBatchRow(**values)


async def get(pool: Database, token: str) -> ProviderBatchRow | None:
    row = await pool.fetchrow(f"SELECT {_COLUMNS} FROM provider_batches WHERE token = $1", token)
    return None if row is None else _row(row)


async def prepared(
    pool: Database,
    *,
    token: str,
    job_id: str,
    shard: int,
    submission: int,
    endpoint: str,
    lease_owner: str,
    input_file_id: str | None,
    url: str | None,
    requests: int,
    followers: dict[str, list[str]],
) -> ProviderBatchRow:
    """Record the uploaded requests file before the batch is created; a row an earlier
    attempt recorded stays (its file is the one to create the batch from)."""
    status = PREPARING if input_file_id else NOTHING_TO_SEND
    await pool.execute(
        """
        INSERT INTO provider_batches (token, job_id, shard, submission, endpoint, lease_owner,
                                      input_file_id, url, status, requests, followers)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb)
        ON CONFLICT (token) DO NOTHING
        """,
        token,
        job_id,
        shard,
        submission,
        endpoint,
        lease_owner,
        input_file_id,
        url,
        status,
        requests,
        json.dumps(followers),
    )
    row = await get(pool, token)
    assert row is not None
    return row


async def record_batch(pool: Database, *, token: str, batch_id: str, status: str) -> str:
    """Record the provider's batch id; the one recorded first wins (returned)."""
    recorded = await pool.fetchval(
        """
        UPDATE provider_batches SET batch_id = COALESCE(batch_id, $2), status = $3,
                                    updated_at = now()
        WHERE token = $1
        RETURNING batch_id
        """,
        token,
        batch_id,
        status,
    )
    return str(recorded)


async def set_status(
    pool: Database, *, token: str, status: BatchStatus, completed: int, failed: int
) -> None:
    await pool.execute(
        """
        UPDATE provider_batches SET status = $2, completed = $3, failed = $4, updated_at = now()
        WHERE token = $1 AND NOT collected
        """,
        token,
        status,
        completed,
        failed,
    )


async def mark_collected(
    pool: Database, *, token: str, prompt_tokens: int, completion_tokens: int
) -> bool:
    """Mark the batch's answers recorded, once; False if they were already."""
    status = await pool.execute(
        """
        UPDATE provider_batches
           SET collected = true, prompt_tokens = $2, completion_tokens = $3, updated_at = now()
        WHERE token = $1 AND NOT collected
        """,
        token,
        prompt_tokens,
        completion_tokens,
    )
    return status.endswith(" 1")


async def job_batches(pool: Database, job_id: str) -> list[ProviderBatchRow]:
    rows = await pool.fetch(
        f"SELECT {_COLUMNS} FROM provider_batches WHERE job_id = $1 ORDER BY shard, submission",
        job_id,
    )
    return [_row(r) for r in rows]
