"""``GET /v1/models``: the models live GPU workers serve, with their task."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.objects import Model, ModelList
from llmbatch.served_models import served_models

router = APIRouter()


async def _polled(svc: Services, task_queue: str) -> bool:
    client = svc.temporal
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
    )
    return bool(response.pollers)


@router.get("/models", response_model=ModelList)
async def list_models(
    project: Annotated[str, Depends(project_of)],
    svc: Annotated[Services, Depends(services)],
) -> ModelList:
    """Every model whose queue a worker polls now (workers record the model behind
    their hashed queue name in Postgres; Temporal says who polls)."""
    rows = await served_models(svc.pool)
    polled = await asyncio.gather(*(_polled(svc, r.task_queue) for r in rows))
    return ModelList(
        data=[
            Model(id=r.model, created=int(r.first_seen.timestamp()), task=r.task)
            for r, live in zip(rows, polled, strict=True)
            if live
        ]
    )
