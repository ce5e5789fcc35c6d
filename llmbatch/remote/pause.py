"""A job paused by llm-batch itself, with the one line that says why.

Used when an endpoint refuses a job's requests (a wrong key, a model it does not
serve): the ledger's paused flag holds every running ``generate`` of the job at
once (they read it every 2 s), and the job's own pause update makes the workflow
start no further shard and show ``paused``, exactly as ``llm-batch pause`` does.
``llm-batch resume`` lifts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from temporalio import activity
from temporalio.client import Client

from llmbatch.contract.names import PAUSE_UPDATE
from llmbatch.ledger.db import Database

log = logging.getLogger(__name__)

UPDATE_TIMEOUT_S = 30.0


async def pause_job(pool: Database, *, job_id: str, reason: str) -> None:
    """Pause ``job_id`` for ``reason`` (one line, shown by ``status``)."""
    await pool.execute(
        "UPDATE jobs SET paused = true, paused_reason = $2, updated_at = now() WHERE job_id = $1",
        job_id,
        reason,
    )
    with contextlib.suppress(RuntimeError):  # outside an activity: the flag alone holds it
        await pause_workflow(activity.client(), job_id=job_id)


async def pause_workflow(client: Client, *, job_id: str) -> None:
    """The job's own pause update: its workflow starts no further shard and shows
    ``paused``; failures are logged (the ledger flag holds the job anyway)."""
    try:
        handle = client.get_workflow_handle(job_id)
        await asyncio.wait_for(handle.execute_update(PAUSE_UPDATE), UPDATE_TIMEOUT_S)
    except Exception as exc:
        log.warning("job %s: pause update not applied: %s", job_id, exc)


async def paused_reason(pool: Database, *, job_id: str) -> str | None:
    """Why llm-batch paused the job, while it is paused (None otherwise)."""
    value = await pool.fetchval(
        "SELECT paused_reason FROM jobs WHERE job_id = $1 AND paused", job_id
    )
    return str(value) if value is not None else None
