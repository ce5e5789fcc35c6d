"""The SQL of an OpenAI Batch API batch's life that the batch job itself writes: its
status (with the ``<status>_at`` timestamp) and the output files it registers.

Ledger style (see llmbatch/ledger.py): plain async functions, one statement each,
fenced in the WHERE clause. The HTTP server imports these too (it sets ``cancelling``).
"""

from __future__ import annotations

import json
from typing import Any

from llmbatch.contract.states import BatchStatus
from llmbatch.ledger import Database

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
