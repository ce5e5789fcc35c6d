"""The OpenAI Batch API's records in the ledger: keys, files, batches (tables of
migrations 0005 and 0006), and the batch life the batch job itself writes: its status
(with the ``<status>_at`` timestamp) and the output files it registers.

Plain async functions over a pool or a connection, as the rest of llmbatch.ledger. Every read
and write of a file or batch names the project in its WHERE clause, so another
project's id is simply not found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from llmbatch.contract.states import BatchStatus
from llmbatch.errors import LlmBatchError
from llmbatch.ledger.db import Database, transaction

Order = Literal["asc", "desc"]

#: Statuses a batch never leaves.
FINAL_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)
# Statuses of the batch's own progress, which must not hide a cancel asked for meanwhile:
# the job goes on to its end (cancelled, or completed if it got there first).
_PROGRESS_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
)

# The purpose of the files a finished batch registers, as OpenAI names it.
BATCH_OUTPUT_PURPOSE = "batch_output"


async def set_batch_status(
    db: Database,
    *,
    batch_id: str,
    status: BatchStatus,
    errors: list[dict[str, Any]] | None = None,
) -> bool:
    """Move a batch to ``status`` and stamp ``<status>_at`` (but validating, which has
    no such column); True when it moved.

    A final status (completed, failed, expired, cancelled) never changes, and
    validating, in_progress and finalizing never replace ``cancelling``. ``errors``
    (the ``errors.data`` entries of a failed batch) is written only when given.
    """
    # The column name comes from the enum, never from a caller's string. The errors go
    # as text, so any pool works (with or without a jsonb codec).
    # "validating" has none: it is the status a batch is created with (created_at).
    stamp = "" if status == BatchStatus.VALIDATING else f", {BatchStatus(status).value}_at = now()"
    result = await db.execute(
        f"""
        UPDATE api_batches
        SET status = $2{stamp}, errors = COALESCE($3::text::jsonb, errors)
        WHERE batch_id = $1
          AND status <> ALL($4::text[])
          AND NOT ($2 = ANY($5::text[]) AND status = $6)
        """,
        batch_id,
        status,
        None if errors is None else json.dumps(errors),
        [str(s) for s in FINAL_STATUSES],
        [str(s) for s in _PROGRESS_STATUSES],
        BatchStatus.CANCELLING,
    )
    return bool(result.endswith(" 1"))


async def register_output_file(
    db: Database,
    *,
    file_id: str,
    project: str,
    filename: str,
    size: int,
    object_uri: str,
    purpose: str = BATCH_OUTPUT_PURPOSE,
) -> None:
    """Record a file a batch wrote (its bytes already at ``object_uri``)."""
    await db.execute(
        "INSERT INTO api_files (file_id, project, purpose, filename, bytes, object_uri) "
        "VALUES ($1, $2, $3, $4, $5, $6)",
        file_id,
        project,
        purpose,
        filename,
        size,
        object_uri,
    )


async def attach_files(
    db: Database, *, batch_id: str, output_file_id: str | None, error_file_id: str | None
) -> bool:
    """Set a batch's output and error file ids, once: a batch that has them (or has
    ended) keeps its own, so a retried assembly cannot swap them. True when set."""
    result = await db.execute(
        """
        UPDATE api_batches SET output_file_id = $2, error_file_id = $3
        WHERE batch_id = $1 AND output_file_id IS NULL AND error_file_id IS NULL
          AND status <> ALL($4::text[])
        """,
        batch_id,
        output_file_id,
        error_file_id,
        [str(s) for s in FINAL_STATUSES],
    )
    return bool(result.endswith(" 1"))


async def batch_status(db: Database, *, batch_id: str) -> BatchStatus | None:
    """A batch's status; None when there is no such batch."""
    status = await db.fetchval("SELECT status FROM api_batches WHERE batch_id = $1", batch_id)
    return None if status is None else BatchStatus(status)


@dataclass(slots=True)
class ApiKey:
    key_id: str
    project: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(slots=True)
class FileRow:
    file_id: str
    project: str
    purpose: str
    filename: str
    bytes: int
    object_uri: str
    created_at: datetime
    lines: int | None


@dataclass(slots=True)
class BatchRow:
    batch_id: str
    project: str
    input_file_id: str
    endpoint: str
    completion_window: str
    model: str
    metadata: dict[str, str] | None
    status: BatchStatus
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None


class TooManyBatches(LlmBatchError):
    """The project already has its limit of unfinished batches."""


# --- keys ---------------------------------------------------------------------------


async def create_key(db: Database, *, key_id: str, project: str, key_hash: str) -> None:
    await db.execute(
        "INSERT INTO api_keys (key_id, project, key_hash) VALUES ($1, $2, $3)",
        key_id,
        project,
        key_hash,
    )


async def project_of_key(db: Database, *, key_hash: str) -> str | None:
    """The project of the live (not revoked) key with this hash."""
    project = await db.fetchval(
        "SELECT project FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL", key_hash
    )
    return str(project) if project is not None else None


async def list_keys(db: Database) -> list[ApiKey]:
    rows = await db.fetch(
        "SELECT key_id, project, created_at, revoked_at FROM api_keys ORDER BY created_at, key_id"
    )
    return [ApiKey(**dict(r)) for r in rows]


async def revoke_key(db: Database, *, key_id: str) -> bool:
    """Revoke a key (once); True when this call revoked it."""
    status = await db.execute(
        "UPDATE api_keys SET revoked_at = now() WHERE key_id = $1 AND revoked_at IS NULL", key_id
    )
    return bool(status.endswith(" 1"))


# --- files --------------------------------------------------------------------------

_FILE_COLUMNS = "file_id, project, purpose, filename, bytes, object_uri, created_at, lines"


async def insert_file(
    db: Database,
    *,
    file_id: str,
    project: str,
    purpose: str,
    filename: str,
    size: int,
    object_uri: str,
    lines: int | None,
) -> FileRow:
    row = await db.fetchrow(
        "INSERT INTO api_files (file_id, project, purpose, filename, bytes, object_uri, lines) "
        f"VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {_FILE_COLUMNS}",
        file_id,
        project,
        purpose,
        filename,
        size,
        object_uri,
        lines,
    )
    assert row is not None
    return FileRow(**dict(row))


async def get_file(db: Database, *, project: str, file_id: str) -> FileRow | None:
    row = await db.fetchrow(
        f"SELECT {_FILE_COLUMNS} FROM api_files "
        "WHERE file_id = $1 AND project = $2 AND deleted_at IS NULL",
        file_id,
        project,
    )
    return FileRow(**dict(row)) if row is not None else None


async def list_files(
    db: Database,
    *,
    project: str,
    limit: int,
    after: str | None = None,
    purpose: str | None = None,
    order: Order = "desc",
) -> tuple[list[FileRow], bool]:
    """A page of the project's files by creation time, and whether more follow.

    ``after`` is a keyset cursor: the files past that one in ``order`` (none when it is
    not a file of this project).
    """
    compare = "<" if order == "desc" else ">"
    direction = "DESC" if order == "desc" else "ASC"
    rows = await db.fetch(
        f"SELECT {_FILE_COLUMNS} FROM api_files f "
        "WHERE project = $1 AND deleted_at IS NULL AND ($2::text IS NULL OR purpose = $2) "
        "AND ($3::text IS NULL OR (created_at, file_id) "
        f"{compare} (SELECT created_at, file_id FROM api_files "
        "WHERE file_id = $3 AND project = $1)) "
        f"ORDER BY created_at {direction}, file_id {direction} LIMIT $4",
        project,
        purpose,
        after,
        limit + 1,
    )
    return [FileRow(**dict(r)) for r in rows[:limit]], len(rows) > limit


async def delete_file(db: Database, *, project: str, file_id: str) -> FileRow | None:
    """Mark the file deleted unless an unfinished batch reads it; the row as it was, or
    None when nothing was deleted."""
    row = await db.fetchrow(
        "UPDATE api_files SET deleted_at = now() "
        "WHERE file_id = $1 AND project = $2 AND deleted_at IS NULL AND NOT EXISTS "
        "(SELECT 1 FROM api_batches b WHERE b.input_file_id = $1 AND b.project = $2 "
        "AND b.status <> ALL($3::text[])) "
        f"RETURNING {_FILE_COLUMNS}",
        file_id,
        project,
        _FINAL,
    )
    return FileRow(**dict(row)) if row is not None else None


# --- batches ------------------------------------------------------------------------

_BATCH_COLUMNS = (
    "batch_id, project, input_file_id, endpoint, completion_window, model, metadata, "
    "status, errors, output_file_id, error_file_id, created_at, expires_at, in_progress_at, "
    "finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at"
)
_FINAL = [str(s) for s in FINAL_STATUSES]


def _batch(row: Any) -> BatchRow:
    data = dict(row)
    data["status"] = BatchStatus(data["status"])
    return BatchRow(**data)


async def insert_batch(
    db: Database,
    *,
    batch_id: str,
    project: str,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    window: timedelta,
    model: str,
    metadata: dict[str, str] | None,
    max_in_progress: int,
) -> BatchRow:
    """Record a new batch (``validating``); raise :class:`TooManyBatches` when the project
    already has ``max_in_progress`` unfinished ones.

    A transaction-scoped advisory lock per project makes count-then-insert one step
    across every server replica. A batch already recorded is returned as it is: its
    workflow's activity writes it, and a retried activity must not count it twice.
    """
    async with transaction(db) as conn:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 11))", project)
        existing = await conn.fetchrow(
            f"SELECT {_BATCH_COLUMNS} FROM api_batches WHERE batch_id = $1 AND project = $2",
            batch_id,
            project,
        )
        if existing is not None:
            return _batch(existing)
        open_count = await conn.fetchval(
            "SELECT count(*) FROM api_batches WHERE project = $1 AND status <> ALL($2::text[])",
            project,
            _FINAL,
        )
        if open_count >= max_in_progress:
            raise TooManyBatches(project)
        row = await conn.fetchrow(
            "INSERT INTO api_batches (batch_id, project, input_file_id, endpoint, "
            "completion_window, model, metadata, expires_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, now() + $8::interval) "
            f"RETURNING {_BATCH_COLUMNS}",
            batch_id,
            project,
            input_file_id,
            endpoint,
            completion_window,
            model,
            metadata,
            window,
        )
    assert row is not None
    return _batch(row)


async def get_batch(db: Database, *, project: str, batch_id: str) -> BatchRow | None:
    row = await db.fetchrow(
        f"SELECT {_BATCH_COLUMNS} FROM api_batches WHERE batch_id = $1 AND project = $2",
        batch_id,
        project,
    )
    return _batch(row) if row is not None else None


async def list_batches(
    db: Database, *, project: str, limit: int, after: str | None = None
) -> tuple[list[BatchRow], bool]:
    """A page of the project's batches, newest first, and whether more follow."""
    rows = await db.fetch(
        f"SELECT {_BATCH_COLUMNS} FROM api_batches WHERE project = $1 "
        "AND ($2::text IS NULL OR (created_at, batch_id) < "
        "(SELECT created_at, batch_id FROM api_batches WHERE batch_id = $2 AND project = $1)) "
        "ORDER BY created_at DESC, batch_id DESC LIMIT $3",
        project,
        after,
        limit + 1,
    )
    return [_batch(r) for r in rows[:limit]], len(rows) > limit
