"""The FastAPI app of ``llm-batch serve``: the OpenAI Batch API on llm-batch.

Stateless: what matters lives in Postgres (keys, files, batches), the object store
(file bytes) and Temporal (each batch is a ``BatchJobWorkflow`` whose id is the batch
id), so any number of replicas answer for any batch, and a restart loses nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from llmbatch import ledger
from llmbatch.api import batches, files, models
from llmbatch.api.deps import Services
from llmbatch.api.errors import install_handlers
from llmbatch.client.temporal import connect
from llmbatch.config import Settings
from llmbatch.storage.s3 import S3Store


def create_app(settings: Settings) -> FastAPI:
    """The API app; its lifespan opens the Postgres pool, the Temporal client and the
    object store, so a server that cannot reach one of them does not start."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
        try:
            temporal = await connect(settings)
            app.state.services = Services(
                settings=settings, pool=pool, temporal=temporal, store=S3Store(settings)
            )
            # Read by auth.project_of, which needs only the pool.
            app.state.pool = pool
            yield
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
    app.include_router(files.router, prefix="/v1")
    app.include_router(batches.router, prefix="/v1")
    app.include_router(models.router, prefix="/v1")
    return app
