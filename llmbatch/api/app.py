"""The FastAPI app of ``llm-batch serve``: the OpenAI Batch API on llm-batch.

Stateless: what matters lives in Postgres (keys, files, batches), the object store
(file bytes) and Temporal (each batch is a ``BatchJobWorkflow`` whose id is the batch
id), so any number of replicas answer for any batch, and a restart loses nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from llmbatch import ledger
from llmbatch.api import batches, files, models, stale_uploads
from llmbatch.api.deps import Services
from llmbatch.api.errors import BACKEND_TIMEOUT_S, install_handlers, refuse_nul
from llmbatch.client.temporal import connect
from llmbatch.config import Settings
from llmbatch.storage.s3 import S3Store


def create_app(settings: Settings) -> FastAPI:
    """The API app; its lifespan opens the Postgres pool, the Temporal client and the
    object store, so a server that cannot reach one of them does not start."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A request answers 503 within seconds when Postgres is away (errors.py),
        # rather than waiting on a connection or a statement for ever.
        pool = await ledger.db.create_pool(
            settings.postgres_dsn.get_secret_value(),
            connect_timeout_s=BACKEND_TIMEOUT_S,
            command_timeout_s=BACKEND_TIMEOUT_S,
        )
        try:
            temporal = await connect(settings)
            app.state.services = Services(
                settings=settings, pool=pool, temporal=temporal, store=S3Store(settings)
            )
            # Read by auth.project_of, which needs only the pool.
            app.state.pool = pool
            sweeper = asyncio.create_task(
                stale_uploads.sweep_forever(
                    app.state.services.store.client,
                    bucket=settings.s3_bucket,
                    older_than=settings.api_stale_upload_after,
                )
            )
            try:
                yield
            finally:
                sweeper.cancel()
        finally:
            await pool.close()

    app = FastAPI(
        title="llm-batch: OpenAI Batch API",
        lifespan=lifespan,
        # The API is the OpenAI one; its reference is OpenAI's, not a page served here.
        docs_url=None,
        redoc_url=None,
    )
    install_handlers(app)
    for router in (files.router, batches.router, models.router):
        app.include_router(router, prefix="/v1", dependencies=[Depends(refuse_nul)])
    return app
