"""API keys: ``Authorization: Bearer <key>`` names a project.

A key is shown once, at creation; Postgres keeps only its sha256, so a copy of the
database lets no one call the API. A key's secret is 32 random bytes, so a plain
(unsalted) hash is as strong as a password hash would be and lookups stay one index
probe.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from fastapi import Request

from llmbatch.api.errors import ApiError
from llmbatch.ledger import api_records
from llmbatch.ledger.db import Database

KEY_PREFIX = "sk-llmb-"


@dataclass(frozen=True, slots=True)
class NewKey:
    key_id: str
    project: str
    secret: str


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def create_key(db: Database, *, project: str) -> NewKey:
    """A new key for ``project``: its secret is in the answer and nowhere else."""
    key = NewKey(
        key_id=f"key_{secrets.token_hex(8)}",
        project=project,
        secret=KEY_PREFIX + secrets.token_urlsafe(32),
    )
    await api_records.create_key(
        db, key_id=key.key_id, project=project, key_hash=hash_key(key.secret)
    )
    return key


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


async def project_of(request: Request) -> str:
    """The caller's project (a FastAPI dependency); 401 without a live key."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise _unauthorized(
            "You didn't provide an API key. Send it in the Authorization header: "
            "'Authorization: Bearer YOUR_KEY'. `llm-batch api-key create` makes one."
        )
    project = await api_records.project_of_key(
        request.app.state.pool, key_hash=hash_key(secret.strip())
    )
    if project is None:
        # Never echo the key: it may be a real one of another service, mistyped.
        raise _unauthorized("Incorrect API key provided (unknown or revoked).")
    return project
