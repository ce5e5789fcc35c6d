"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live GPU workers serve,
with their task."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends

from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.errors import not_found
from llmbatch.api.objects import Model, ModelList
from llmbatch.client.temporal import queue_has_pollers
from llmbatch.ledger.served_models import served_models

router = APIRouter()


async def _live_models(svc: Services) -> list[Model]:
    """Every model whose queue a worker polls now (workers record the model behind
    their hashed queue name in Postgres; Temporal says who polls)."""
    rows = await served_models(svc.pool)
    polled = await asyncio.gather(*(queue_has_pollers(svc.temporal, r.task_queue) for r in rows))
    return [
        Model(id=r.model, created=int(r.first_seen.timestamp()), task=r.task)
        for r, live in zip(rows, polled, strict=True)
        if live
    ]


@router.get("/models", response_model=ModelList)
async def list_models(
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> ModelList:
    """One entry per model and task that live workers serve."""
    return ModelList(data=await _live_models(svc))


# A model id may be a local path: ``path`` takes its slashes (the client sends
# ``/v1/models//models/tiny`` for ``/models/tiny``).
@router.get("/models/{model_id:path}", response_model=Model)
async def retrieve_model(
    model_id: str,
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> Model:
    """The model, if a live worker serves it (the first of its tasks, by name)."""
    for model in await _live_models(svc):
        if model.id == model_id:
            return model
    raise not_found("Model", model_id, param="model")
