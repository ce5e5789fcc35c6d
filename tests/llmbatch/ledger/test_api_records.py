"""The batch status and output-file SQL, each test on a fresh migrated database."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from llmbatch.contract.states import BatchStatus
from llmbatch.ledger import api_records as records

BATCH = "batch_0123"


async def new_batch(pool: asyncpg.Pool, batch_id: str = BATCH) -> None:
    await pool.execute(
        "INSERT INTO api_batches (batch_id, project, input_file_id, endpoint, "
        "completion_window, model, expires_at) "
        "VALUES ($1, 'p', 'file-in', '/v1/chat/completions', '24h', 'm', now())",
        batch_id,
    )


async def row(pool: asyncpg.Pool, batch_id: str = BATCH) -> dict[str, Any]:
    found = await pool.fetchrow("SELECT * FROM api_batches WHERE batch_id = $1", batch_id)
    assert found is not None
    return dict(found)


async def test_each_status_stamps_its_own_time_and_errors_are_kept(
    ledger_pool: asyncpg.Pool,
) -> None:
    await new_batch(ledger_pool)
    assert await records.set_batch_status(
        ledger_pool, batch_id=BATCH, status=BatchStatus.IN_PROGRESS
    )
    assert await records.set_batch_status(
        ledger_pool, batch_id=BATCH, status=BatchStatus.FINALIZING
    )
    errors = [{"code": "x", "message": "m", "param": None, "line": 3}]
    assert await records.set_batch_status(
        ledger_pool, batch_id=BATCH, status=BatchStatus.FAILED, errors=errors
    )
    batch = await row(ledger_pool)
    assert batch["status"] == BatchStatus.FAILED
    assert batch["errors"] == errors
    assert batch["in_progress_at"] <= batch["finalizing_at"] <= batch["failed_at"]
    assert batch["completed_at"] is None
    assert await records.batch_status(ledger_pool, batch_id=BATCH) == BatchStatus.FAILED
    assert await records.batch_status(ledger_pool, batch_id="batch_none") is None


@pytest.mark.parametrize("final", records.FINAL_STATUSES)
async def test_a_final_status_never_changes(ledger_pool: asyncpg.Pool, final: BatchStatus) -> None:
    await new_batch(ledger_pool)
    assert await records.set_batch_status(ledger_pool, batch_id=BATCH, status=final)
    for status in BatchStatus:
        moved = await records.set_batch_status(
            ledger_pool, batch_id=BATCH, status=status, errors=[{"code": "late"}]
        )
        assert not moved, status
    batch = await row(ledger_pool)
    assert batch["status"] == final
    assert batch["errors"] is None
    assert batch["cancelling_at"] is None


async def test_cancelling_is_not_hidden_by_progress_but_ends_in_a_final_status(
    ledger_pool: asyncpg.Pool,
) -> None:
    await new_batch(ledger_pool)
    assert await records.set_batch_status(
        ledger_pool, batch_id=BATCH, status=BatchStatus.CANCELLING
    )
    for status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING):
        assert not await records.set_batch_status(ledger_pool, batch_id=BATCH, status=status)
    assert (await row(ledger_pool))["status"] == BatchStatus.CANCELLING
    # The job got to its end before the cancel reached it: OpenAI's "completed" wins.
    assert await records.set_batch_status(ledger_pool, batch_id=BATCH, status=BatchStatus.COMPLETED)
    assert (await row(ledger_pool))["status"] == BatchStatus.COMPLETED


async def test_output_files_are_registered_and_attached_once(ledger_pool: asyncpg.Pool) -> None:
    await new_batch(ledger_pool)
    await records.register_output_file(
        ledger_pool,
        file_id="file-out",
        project="p",
        filename=f"{BATCH}_output.jsonl",
        size=12,
        object_uri="s3://b/api/files/file-out",
    )
    file = await ledger_pool.fetchrow("SELECT * FROM api_files WHERE file_id = 'file-out'")
    assert file is not None
    assert (file["purpose"], file["project"], file["bytes"]) == ("batch_output", "p", 12)
    assert await records.attach_files(
        ledger_pool, batch_id=BATCH, output_file_id="file-out", error_file_id=None
    )
    # A retried assembly cannot swap the files.
    assert not await records.attach_files(
        ledger_pool, batch_id=BATCH, output_file_id="file-2", error_file_id="file-3"
    )
    batch = await row(ledger_pool)
    assert (batch["output_file_id"], batch["error_file_id"]) == ("file-out", None)
    # Nor can anything attach files to an ended batch.
    await new_batch(ledger_pool, "batch_ended")
    await records.set_batch_status(ledger_pool, batch_id="batch_ended", status=BatchStatus.EXPIRED)
    assert not await records.attach_files(
        ledger_pool, batch_id="batch_ended", output_file_id="file-4", error_file_id=None
    )
