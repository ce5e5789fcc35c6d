"""Where a job runs, for every way in (``submit``, ``schedule create``, the OpenAI Batch
API): the endpoint it names, else its model's route, online or through the endpoint's
Batch API (``endpoint add|update NAME --serve-as MODEL --serve-via batch``).

In this package because a job via batch needs the endpoint's Batch API declared
(:func:`llmbatch.provider.settings.batch_endpoint`); routes are :mod:`llmbatch.remote.routes`'.
"""

from __future__ import annotations

from llmbatch.contract.spec import EndpointVia, JobSpec
from llmbatch.ledger.db import Database
from llmbatch.provider.settings import batch_endpoint
from llmbatch.remote.endpoints import get_endpoint
from llmbatch.remote.routes import route_for


async def place(db: Database, spec: JobSpec) -> JobSpec:
    """The spec with its engine settled. An endpoint it names must be declared (a job
    on an undeclared one would wait for ever), with a Batch API if the job goes via
    batch; a job naming none takes its model's route, if an operator routed the model
    to an endpoint. Raises :class:`~llmbatch.remote.endpoints.EndpointError`."""
    if spec.remote_endpoint is None:
        route = await route_for(db, model=spec.model, task=spec.task)
        if route is None:
            return spec  # GPU workers run it
        spec = spec.model_copy(update={"remote_endpoint": route.endpoint, "via": route.via})
    assert spec.remote_endpoint is not None
    await (batch_endpoint if spec.via is EndpointVia.BATCH else get_endpoint)(
        db, spec.remote_endpoint
    )
    return spec
