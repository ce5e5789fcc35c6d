"""The endpoint registry: one Postgres row per endpoint, declared once.

An endpoint holds where to send requests and the limits to send them within; never
the API key, which the worker reads from the environment variable (or file) the row
names, so it is in no spec, history, search attribute, log or ledger row.

Running workers read the row every second (:mod:`.watch`): a change made here
reaches them within seconds. ``update_endpoint`` and ``lift_job_wait`` (a job's
``resume``) also lift the endpoint's shared Retry-After wait and count up its
generation, which drops the waits workers hold in memory.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmbatch.contract.spec import ENDPOINT_NAME_PATTERN
from llmbatch.errors import LlmBatchError
from llmbatch.ledger.db import Database

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

DEFAULT_MAX_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 600.0


class EndpointError(LlmBatchError, ValueError):
    """An endpoint that is not there, or options it cannot take; one line."""


class EndpointConfig(BaseModel):
    """What ``endpoint add`` declares (and ``endpoint update`` changes)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ENDPOINT_NAME_PATTERN)
    base_url: str = Field(min_length=1)
    api_key_env: str | None = Field(default=None, pattern=ENV_NAME_PATTERN)
    api_key_file: str | None = None
    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    max_concurrency: int = Field(default=DEFAULT_MAX_CONCURRENCY, gt=0)
    input_price: float | None = Field(default=None, ge=0, description="USD per 1M tokens")
    output_price: float | None = Field(default=None, ge=0, description="USD per 1M tokens")
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        value = value.rstrip("/")
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"base URL {value!r} is not an http(s) URL")
        # The key goes in a header, never in the URL (where logs would keep it).
        if "@" in value.split("/", 3)[2]:
            raise ValueError("put no credentials in the base URL; use --api-key-env")
        return value

    def cost_usd(self, *, prompt_tokens: int, completion_tokens: int) -> float:
        """What these tokens cost at the endpoint's prices (0 where none is set)."""
        return (
            prompt_tokens * (self.input_price or 0.0)
            + completion_tokens * (self.output_price or 0.0)
        ) / 1e6


class Endpoint(EndpointConfig):
    """An endpoint as the registry has it."""

    created_at: datetime | None = None
    updated_at: datetime | None = None

    def options(self) -> dict[str, Any]:
        """What ``endpoint add`` declared (the row's bookkeeping left out)."""
        return self.model_dump(include=set(EndpointConfig.model_fields))

    def weights(self, model: str) -> str:
        """What stands for the weights behind ``model`` here, for the result cache: the
        endpoint's URL and the model's name (a provider may change what a name answers:
        see the docs)."""
        return f"endpoint:{self.base_url}:{model}"

    def api_key(self) -> str | None:
        """The key, read now from the worker's environment (or the named file); None
        when the endpoint needs none. Never logged, never stored by llm-batch."""
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise EndpointError(
                    f"endpoint {self.name}: environment variable {self.api_key_env} "
                    "(its API key) is not set in this worker's environment"
                )
            return key.strip()
        if self.api_key_file is not None:
            try:
                return Path(self.api_key_file).read_text().strip()
            except OSError as exc:
                raise EndpointError(
                    f"endpoint {self.name}: cannot read its API key file "
                    f"{self.api_key_file}: {exc.strerror}"
                ) from None
        return None


COLUMNS = (
    "name, base_url, api_key_env, api_key_file, rpm, tpm, max_concurrency, input_price, "
    "output_price, timeout_s, created_at, updated_at"
)
_SETTABLE = (
    "base_url",
    "api_key_env",
    "api_key_file",
    "rpm",
    "tpm",
    "max_concurrency",
    "input_price",
    "output_price",
    "timeout_s",
)


# Lifts the endpoint's shared wait; the new generation tells every worker to drop its own.
_LIFT = "blocked_until = 'epoch', blocked_reason = NULL, generation = generation + 1"


async def lift_job_wait(pool: Database, *, job_id: str) -> str | None:
    """A job is resumed: lift the wait of the endpoint it runs on, everywhere (the
    operator says go on). Returns the endpoint's name (None: not a remote job)."""
    value = await pool.fetchval(
        f"""
        UPDATE endpoints e SET {_LIFT}
          FROM jobs j
         WHERE j.job_id = $1 AND e.name = j.spec->>'remote_endpoint'
        RETURNING e.name
        """,
        job_id,
    )
    return str(value) if value is not None else None


async def add_endpoint(pool: Database, config: EndpointConfig) -> Endpoint:
    """Declare an endpoint; an existing name is refused (use update)."""
    values = config.model_dump()
    try:
        row = await pool.fetchrow(
            f"""
            INSERT INTO endpoints (name, {", ".join(_SETTABLE)})
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
            RETURNING {COLUMNS}
            """,
            config.name,
            *(values[c] for c in _SETTABLE),
        )
    except asyncpg.UniqueViolationError:
        raise EndpointError(
            f"endpoint {config.name} exists already (change it with endpoint update)"
        ) from None
    return Endpoint.model_validate(dict(row))


async def update_endpoint(pool: Database, name: str, changes: dict[str, Any]) -> Endpoint:
    """Change some of an endpoint's options (validated as a whole)."""
    current = await get_endpoint(pool, name)
    unknown = set(changes) - set(_SETTABLE)
    if unknown:
        raise EndpointError(f"cannot change {', '.join(sorted(unknown))}")
    merged = EndpointConfig.model_validate({**current.options(), **changes})
    values = merged.model_dump()
    # Whatever changed (or nothing: `endpoint update NAME` alone), the operator has
    # looked at the endpoint: its Retry-After wait ends here and in every worker.
    row = await pool.fetchrow(
        f"""
        UPDATE endpoints
           SET {", ".join(f"{c} = ${i}" for i, c in enumerate(_SETTABLE, start=2))},
               updated_at = now(),
               {_LIFT}
         WHERE name = $1
        RETURNING {COLUMNS}
        """,
        name,
        *(values[c] for c in _SETTABLE),
    )
    if row is None:
        raise EndpointError(f"no endpoint named {name}")
    return Endpoint.model_validate(dict(row))


async def get_endpoint(pool: Database, name: str) -> Endpoint:
    row = await pool.fetchrow(f"SELECT {COLUMNS} FROM endpoints WHERE name = $1", name)
    if row is None:
        raise EndpointError(f"no endpoint named {name} (declare it with endpoint add)")
    return Endpoint.model_validate(dict(row))


async def list_endpoints(pool: Database) -> list[Endpoint]:
    rows = await pool.fetch(f"SELECT {COLUMNS} FROM endpoints ORDER BY name")
    return [Endpoint.model_validate(dict(r)) for r in rows]


async def remove_endpoint(pool: Database, name: str) -> None:
    status = await pool.execute("DELETE FROM endpoints WHERE name = $1", name)
    if not status.endswith(" 1"):
        raise EndpointError(f"no endpoint named {name}")
