"""What an endpoint declares about its Batch API: batch prices and limits.

A row of ``endpoint_batch_api`` beside the endpoint's own (``endpoints``); an endpoint
without one does not take ``--via batch`` jobs.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmbatch.ledger.db import Database
from llmbatch.remote.endpoints import Endpoint, EndpointError, get_endpoint

# OpenAI's limits per batch.
DEFAULT_MAX_REQUESTS = 50_000
DEFAULT_MAX_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_IN_FLIGHT = 100
DEFAULT_WINDOW = "24h"


class BatchApiConfig(BaseModel):
    """``endpoint add|update --batch-api`` options."""

    model_config = ConfigDict(extra="forbid")

    batch_input_price: float | None = Field(default=None, ge=0, description="USD per 1M tokens")
    batch_output_price: float | None = Field(default=None, ge=0, description="USD per 1M tokens")
    max_requests: int = Field(default=DEFAULT_MAX_REQUESTS, gt=0)
    max_bytes: int = Field(default=DEFAULT_MAX_BYTES, gt=0)
    max_in_flight: int = Field(default=DEFAULT_MAX_IN_FLIGHT, gt=0)
    completion_window: str = DEFAULT_WINDOW

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        if not re.fullmatch(r"\d+[smh]", value):
            raise ValueError("completion window must be like '24h', '30m' or '90s'")
        return value

    def line(self) -> str:
        prices = (
            f"${self.batch_input_price or 0:g}/${self.batch_output_price or 0:g} per 1M tokens"
            if self.batch_input_price is not None or self.batch_output_price is not None
            else "no batch prices"
        )
        return (
            f"{prices}, {self.max_requests} requests or {self.max_bytes} bytes a batch, "
            f"{self.max_in_flight} in flight, window {self.completion_window}"
        )

    def cost_usd(self, *, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * (self.batch_input_price or 0.0)
            + completion_tokens * (self.batch_output_price or 0.0)
        ) / 1e6


_FIELDS = tuple(BatchApiConfig.model_fields)


async def set_batch_api(pool: Database, endpoint: str, changes: dict[str, Any]) -> BatchApiConfig:
    """Declare (or change some options of) ``endpoint``'s Batch API."""
    await get_endpoint(pool, endpoint)
    current = await get_batch_api(pool, endpoint)
    merged = BatchApiConfig.model_validate(
        {**(current.model_dump() if current is not None else {}), **changes}
    )
    values = merged.model_dump()
    await pool.execute(
        f"""
        INSERT INTO endpoint_batch_api (endpoint, {", ".join(_FIELDS)})
        VALUES ($1, {", ".join(f"${i}" for i in range(2, len(_FIELDS) + 2))})
        ON CONFLICT (endpoint) DO UPDATE
           SET {", ".join(f"{c} = EXCLUDED.{c}" for c in _FIELDS)}, updated_at = now()
        """,
        endpoint,
        *(values[c] for c in _FIELDS),
    )
    return merged


async def get_batch_api(pool: Database, endpoint: str) -> BatchApiConfig | None:
    row = await pool.fetchrow(
        f"SELECT {', '.join(_FIELDS)} FROM endpoint_batch_api WHERE endpoint = $1", endpoint
    )
    return None if row is None else BatchApiConfig.model_validate(dict(row))


async def batch_endpoint(pool: Database, name: str) -> tuple[Endpoint, BatchApiConfig]:
    """The endpoint and its Batch API; an endpoint without one is refused."""
    endpoint = await get_endpoint(pool, name)
    batch_api = await get_batch_api(pool, name)
    if batch_api is None:
        raise EndpointError(
            f"endpoint {name} does not declare a Batch API "
            f"(llm-batch endpoint update {name} --batch-api)"
        )
    return endpoint, batch_api
