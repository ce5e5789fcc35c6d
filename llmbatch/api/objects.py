"""What the API answers, field for field as the official ``openai`` client's types have
it (openai/types/file_object.py, batch.py, batch_request_counts.py, batch_usage.py,
batch_error.py, model.py, and the cursor pages of openai/pagination.py)."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from llmbatch.contract.states import BatchStatus
from llmbatch.formats.openai_validation import BatchError

FilePurpose = Literal["batch", "batch_output"]
T = TypeVar("T")


class FileObject(BaseModel):
    id: str
    bytes: int
    created_at: int
    filename: str
    object: Literal["file"] = "file"
    purpose: FilePurpose
    # A file is whole once its row exists: the row is written after the last byte.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchErrors(BaseModel):
    data: list[BatchError] | None = None
    object: str | None = "list"


class BatchRequestCounts(BaseModel):
    completed: int
    failed: int
    total: int


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class Batch(BaseModel):
    id: str
    completion_window: str
    created_at: int
    endpoint: str
    input_file_id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus
    cancelled_at: int | None = None
    cancelling_at: int | None = None
    completed_at: int | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    expired_at: int | None = None
    expires_at: int | None = None
    failed_at: int | None = None
    finalizing_at: int | None = None
    in_progress_at: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    output_file_id: str | None = None
    request_counts: BatchRequestCounts | None = None
    usage: BatchUsage | None = None


class Model(BaseModel):
    id: str
    created: int
    object: Literal["model"] = "model"
    owned_by: str = "llm-batch"
    shutdown_date: str | None = None
    # Not in OpenAI's type (its client keeps unknown fields): what the model's live
    # workers run, e.g. ["embed", "generate"], and the first of them (as before).
    tasks: list[str]
    task: str


class CursorPage(BaseModel, Generic[T]):
    """A list page as the client's ``SyncCursorPage`` reads it: it asks for the next
    page with ``after`` = the last item's id while ``has_more``."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


def page(items: list[Any], *, has_more: bool) -> dict[str, Any]:
    """The fields of a :class:`CursorPage` over ``items`` (objects with an ``id``)."""
    return {
        "data": items,
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
        "has_more": has_more,
    }


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
