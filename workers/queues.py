"""The engine queues' backlog, read from Temporal and the ledger together: for
``llm-batch queues`` and for the gauges the CPU worker exports."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from temporalio.client import Client

from llmbatch.client.queues import QueueBacklog, QueueGauges, WorkerRecord, engine_queues
from llmbatch.config import Settings
from llmbatch.ledger.backlog import unfinished_by_model
from llmbatch.ledger.db import Database
from llmbatch.ledger.served_models import served_models

log = logging.getLogger(__name__)

# How often the CPU worker refreshes the gauges (KEDA polls every 30 s by default).
EXPORT_EVERY_S = 30.0


async def read_queues(client: Client, db: Database, settings: Settings) -> list[QueueBacklog]:
    """Every known engine queue: Temporal's stats beside the ledger's unfinished items."""
    rows = await served_models(db)
    now = datetime.now(UTC)
    records = {
        row.task_queue: WorkerRecord(
            identity=row.identity,
            serving=row.serving(now),
            stopped_at=row.stopped_at.timestamp() if row.stopped_at is not None else None,
        )
        for row in rows
    }
    return await engine_queues(
        client,
        settings,
        served=[(s.task_queue, s.model, s.task) for s in rows],
        unfinished=await unfinished_by_model(db),
        records=records,
    )


async def export_gauges(
    client: Client, db: Database, settings: Settings, *, every_s: float = EXPORT_EVERY_S
) -> None:
    """Refresh the gauges every ``every_s`` until cancelled (run by the CPU worker)."""
    gauges = QueueGauges()
    while True:
        started = time.monotonic()
        try:
            gauges.record(await read_queues(client, db, settings))
        except Exception as exc:  # a metric gap, never a worker failure
            # Info, not a warning: with Temporal or Postgres away the worker itself says
            # so in one line; a gauge that keeps its last value for a round is no news.
            log.info("queue gauges not refreshed: %s", exc)
        await asyncio.sleep(max(every_s - (time.monotonic() - started), 1.0))
