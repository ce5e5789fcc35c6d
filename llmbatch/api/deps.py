"""What request handlers share: the services the app's lifespan opened."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
from fastapi import Request
from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.storage.s3 import S3Store


@dataclass(slots=True)
class Services:
    """Opened once per server process (see ``app.create_app``)."""

    settings: Settings
    pool: asyncpg.Pool
    temporal: Client
    store: S3Store


def services(request: Request) -> Services:
    """The app's services (a FastAPI dependency)."""
    found = request.app.state.services
    assert isinstance(found, Services)
    return found
