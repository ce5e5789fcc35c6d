"""Models routed to endpoints: which endpoint runs a model's work, declared once.

``llm-batch endpoint add|update NAME --serve-as MODEL`` keeps (model, task) → endpoint
in Postgres (``endpoint_models``). Every way in reads it from here: the OpenAI Batch
API (a batch whose lines name MODEL runs on the endpoint's remote worker queue, and
``GET /v1/models`` lists MODEL), ``llm-batch submit`` and ``llm-batch schedule create``
(a job for MODEL without ``--endpoint`` takes the route). A model with no route runs
on GPU workers, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import Task
from llmbatch.ledger.db import Database, transaction
from llmbatch.remote.endpoints import EndpointError


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """``model`` (for ``task``) runs on ``endpoint``."""

    model: str
    task: Task
    endpoint: str
    created_at: datetime


async def set_routes(db: Database, *, endpoint: str, task: Task, models: Sequence[str]) -> None:
    """Route exactly ``models`` (for ``task``) to ``endpoint``: the endpoint's other
    routes of the task are dropped. A model routed to another endpoint is refused."""
    names = sorted({model_identity(m) for m in models if m.strip()})
    async with transaction(db) as conn:
        await conn.execute(
            "DELETE FROM endpoint_models WHERE endpoint = $1 AND task = $2 "
            "AND NOT (model = ANY($3::text[]))",
            endpoint,
            str(task),
            names,
        )
        try:
            await conn.execute(
                "INSERT INTO endpoint_models (model, task, endpoint) "
                "SELECT unnest($1::text[]), $2, $3 ON CONFLICT (model, task) DO NOTHING",
                names,
                str(task),
                endpoint,
            )
        except asyncpg.ForeignKeyViolationError:
            raise EndpointError(f"no endpoint named {endpoint}") from None
        # Checked after the insert, in its transaction: a route another endpoint holds
        # (or took meanwhile) was left alone by it, and raising rolls everything back.
        taken = await conn.fetch(
            "SELECT model, endpoint FROM endpoint_models "
            "WHERE task = $1 AND model = ANY($2::text[]) AND endpoint <> $3",
            str(task),
            names,
            endpoint,
        )
        if taken:
            which = ", ".join(f"{r['model']} (on {r['endpoint']})" for r in taken)
            raise EndpointError(
                f"already routed to another endpoint for {task}: {which}; take it off "
                "there first (llm-batch endpoint update OTHER --serve-as ...)"
            )


async def routes(db: Database, *, endpoint: str | None = None) -> list[ModelRoute]:
    """Every route (or the endpoint's), by model then task."""
    rows = await db.fetch(
        "SELECT model, task, endpoint, created_at FROM endpoint_models "
        "WHERE $1::text IS NULL OR endpoint = $1 ORDER BY model, task",
        endpoint,
    )
    return [
        ModelRoute(
            model=r["model"],
            task=Task(r["task"]),
            endpoint=r["endpoint"],
            created_at=r["created_at"],
        )
        for r in rows
    ]


async def endpoint_for(db: Database, *, model: str, task: Task) -> str | None:
    """The endpoint ``model`` is routed to for ``task``; None: GPU workers run it."""
    name = await db.fetchval(
        "SELECT endpoint FROM endpoint_models WHERE model = $1 AND task = $2",
        model_identity(model),
        str(task),
    )
    return str(name) if name is not None else None
