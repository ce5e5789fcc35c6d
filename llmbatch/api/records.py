"""A batch's status record in ``api_batches``, written by the server and the workflow side.

PLACEHOLDER until the api-flow branch lands: it owns this module (with fenced status
transitions and the output-file registration); at the merge its version replaces this
one. Only the signature the server calls is declared here.
"""

from __future__ import annotations

from typing import Any

from llmbatch.contract.states import BatchStatus
from llmbatch.ledger import Database

FINAL_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)


async def set_batch_status(
    db: Database,
    *,
    batch_id: str,
    status: BatchStatus,
    errors: list[dict[str, Any]] | None = None,
) -> bool:
    """Move a batch to ``status`` (stamping its ``<status>_at`` once); True when it moved.
    A final status never changes."""
    column = f"{BatchStatus(status).value}_at"
    result = await db.execute(
        f"UPDATE api_batches SET status = $2, {column} = coalesce({column}, now()), "
        "errors = coalesce($3, errors) "
        "WHERE batch_id = $1 AND status <> ALL($4::text[])",
        batch_id,
        status,
        errors,
        [str(s) for s in FINAL_STATUSES],
    )
    return bool(result.endswith(" 1"))
