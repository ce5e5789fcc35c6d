"""Models routed to endpoints: which endpoint runs a model's work, declared once.

``llm-batch endpoint add|update NAME --serve-as MODEL`` keeps (model, task) → endpoint
in Postgres (``endpoint_models``), and ``--serve-via batch`` how its generate work runs
there: through the endpoint's Batch API instead of online (the route's ``via``). Every
way in reads it (through :func:`llmbatch.provider.placement.place`): the OpenAI Batch
API (a batch whose lines name MODEL runs on the endpoint's remote worker queue, or as
provider batches, and ``GET /v1/models`` lists MODEL), ``llm-batch submit`` and
``llm-batch schedule create`` (a job for MODEL without ``--endpoint`` takes the route).
A model with no route runs on GPU workers, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from llmbatch.contract.names import model_id
from llmbatch.contract.spec import EndpointVia, Task
from llmbatch.ledger.db import Database, transaction
from llmbatch.remote.endpoints import EndpointError


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """``model`` (for ``task``) runs on ``endpoint``, online or via its Batch API."""

    model: str
    task: Task
    endpoint: str
    created_at: datetime
    via: EndpointVia = EndpointVia.ONLINE


async def set_routes(db: Database, *, endpoint: str, task: Task, models: Sequence[str]) -> None:
    """Route exactly ``models`` (for ``task``) to ``endpoint``: the endpoint's other
    routes of the task are dropped. A model routed to another endpoint is refused. A
    new route runs as the endpoint's routes of the task already do (:func:`set_via`)."""
    names = sorted({model_id(m) for m in models if m.strip()})
    async with transaction(db) as conn:
        via = await conn.fetchval(
            "SELECT via FROM endpoint_models WHERE endpoint = $1 AND task = $2 LIMIT 1",
            endpoint,
            str(task),
        )
        await conn.execute(
            "DELETE FROM endpoint_models WHERE endpoint = $1 AND task = $2 "
            "AND NOT (model = ANY($3::text[]))",
            endpoint,
            str(task),
            names,
        )
        try:
            await conn.execute(
                "INSERT INTO endpoint_models (model, task, endpoint, via) "
                "SELECT unnest($1::text[]), $2, $3, $4 ON CONFLICT (model, task) DO NOTHING",
                names,
                str(task),
                endpoint,
                via or str(EndpointVia.ONLINE),
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


async def set_via(db: Database, *, endpoint: str, via: EndpointVia) -> int:
    """Run the endpoint's routed generate models ``via`` its Batch API or online; the
    number of routes changed (0: the endpoint has none). Whether the endpoint declares
    a Batch API is the caller's check (:mod:`llmbatch.provider.placement`)."""
    status = await db.execute(
        "UPDATE endpoint_models SET via = $2 WHERE endpoint = $1 AND task = $3",
        endpoint,
        str(via),
        str(Task.GENERATE),
    )
    return int(status.split()[-1])


async def routes(db: Database, *, endpoint: str | None = None) -> list[ModelRoute]:
    """Every route (or the endpoint's), by model then task."""
    rows = await db.fetch(
        f"SELECT {_COLUMNS} FROM endpoint_models "
        "WHERE $1::text IS NULL OR endpoint = $1 ORDER BY model, task",
        endpoint,
    )
    return [_route(r) for r in rows]


async def route_for(db: Database, *, model: str, task: Task) -> ModelRoute | None:
    """The route of ``model`` for ``task``; None: GPU workers run it."""
    row = await db.fetchrow(
        f"SELECT {_COLUMNS} FROM endpoint_models WHERE model = $1 AND task = $2",
        model_id(model),
        str(task),
    )
    return None if row is None else _route(row)


_COLUMNS = "model, task, endpoint, created_at, via"


def _route(row: asyncpg.Record) -> ModelRoute:
    return ModelRoute(
        model=row["model"],
        task=Task(row["task"]),
        endpoint=row["endpoint"],
        created_at=row["created_at"],
        via=EndpointVia(row["via"]),
    )
