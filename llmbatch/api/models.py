"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live GPU workers serve
and the models routed to remote endpoints, each once, with their tasks.

An endpoint's model is listed by the name it is routed under, owned by llm-batch:
never the endpoint's name, base URL, or where its key is kept. A model a GPU worker
loaded from a local path is listed by its name (:func:`names.model_identity`), never the
server's path.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends

from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.errors import BACKEND_TIMEOUT_S, not_found
from llmbatch.api.objects import Model, ModelList
from llmbatch.client.temporal import queue_has_pollers
from llmbatch.contract import names
from llmbatch.contract.spec import Task
from llmbatch.ledger.served_models import served_models
from llmbatch.remote.routes import routes

router = APIRouter()
_TIMEOUT = timedelta(seconds=BACKEND_TIMEOUT_S)


async def _models(svc: Services) -> list[Model]:
    """Every model whose GPU queue a worker polls now, and every model routed to an
    endpoint (its batches are accepted and wait while its workers are scaled to zero),
    once, with its tasks."""
    rows = [
        r
        for r in await served_models(svc.pool)
        # Remote workers record their queues too (for `llm-batch queues`); what they
        # serve is listed by route below, so a model no route names is not offered.
        if r.task_queue == svc.settings.gpu_task_queue(r.model, Task(r.task))
    ]
    polled = await asyncio.gather(
        *(queue_has_pollers(svc.temporal, r.task_queue, rpc_timeout=_TIMEOUT) for r in rows)
    )
    seen = [
        (names.model_identity(row.model), row.task, row.first_seen)
        for row, live in zip(rows, polled, strict=True)
        if live
    ]
    seen += [(r.model, str(r.task), r.created_at) for r in await routes(svc.pool)]
    tasks: dict[str, set[str]] = {}
    created: dict[str, int] = {}
    for model, task, first_seen in seen:
        tasks.setdefault(model, set()).add(task)
        first = int(first_seen.timestamp())
        created[model] = min(created.get(model, first), first)
    return [
        Model(id=model, created=created[model], tasks=sorted(ts), task=sorted(ts)[0])
        for model, ts in sorted(tasks.items())
    ]


@router.get("/models", response_model=ModelList)
async def list_models(
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> ModelList:
    """One entry per model that live GPU workers serve or an endpoint is routed, with
    its tasks."""
    return ModelList(data=await _models(svc))


# A model id may be a local path: ``path`` takes its slashes (the client sends
# ``/v1/models//models/tiny`` for ``/models/tiny``).
@router.get("/models/{model_id:path}", response_model=Model)
async def retrieve_model(
    model_id: str,
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> Model:
    """The model, if a live GPU worker serves it or it is routed to an endpoint (the
    first of its tasks, by name)."""
    # A GPU worker's model by its name or its path; a routed model by its id.
    ids = {names.model_identity(model_id), names.model_id(model_id)}
    for model in await _models(svc):
        if model.id in ids:
            return model
    raise not_found("Model", model_id, param="model")
