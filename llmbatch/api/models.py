"""``GET /v1/models``: the models live GPU workers serve, with their task."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends

from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.objects import Model, ModelList
from llmbatch.client import queue_has_pollers
from llmbatch.served_models import served_models

router = APIRouter()


@router.get("/models", response_model=ModelList)
async def list_models(
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> ModelList:
    """Every model whose queue a worker polls now (workers record the model behind
    their hashed queue name in Postgres; Temporal says who polls)."""
    rows = await served_models(svc.pool)
    polled = await asyncio.gather(*(queue_has_pollers(svc.temporal, r.task_queue) for r in rows))
    return ModelList(
        data=[
            Model(id=r.model, created=int(r.first_seen.timestamp()), task=r.task)
            for r, live in zip(rows, polled, strict=True)
            if live
        ]
    )
