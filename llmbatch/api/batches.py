"""``/v1/batches``: create, get, list, cancel. A batch is a ``BatchJobWorkflow`` whose
id is the batch id; its record (``api_batches``) carries OpenAI's status and times,
and its live counts come from the item ledger."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import ledger
from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.errors import BACKEND_TIMEOUT_S, ApiError, ErrorType, not_found
from llmbatch.api.objects import (
    Batch,
    BatchError,
    BatchErrors,
    BatchRequestCounts,
    BatchUsage,
    CursorPage,
    page,
)
from llmbatch.client.quotas import QUOTA_SETTING
from llmbatch.client.temporal import model_has_worker, start_api_batch
from llmbatch.contract.messages import ApiBatchRecordInput
from llmbatch.contract.spec import ApiBatch, ApiEndpoint, InputFormat, JobSpec, Task
from llmbatch.contract.states import BatchStatus, FailureType
from llmbatch.formats import openai_validation
from llmbatch.ledger import api_layout, api_records, served_models
from llmbatch.ledger.api_records import FINAL_STATUSES, set_batch_status
from llmbatch.provider.placement import place
from llmbatch.remote.endpoints import EndpointError

log = logging.getLogger(__name__)
router = APIRouter()

Project = Annotated[str, Depends(project_of)]
Svc = Annotated[Services, Depends(services)]

# OpenAI takes "24h" only. Shorter windows ("90s", "10m", "2h") are an extension, so a
# caller (or a test) can see a batch expire; longer ones are refused as OpenAI does.
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW = timedelta(hours=24)
# How long a create waits for the batch's workflow to write its record (a CPU worker
# takes it in its first task; longer only when none is polling).
CREATE_WAIT_S = 30.0
# The model is read from the first lines of the input: at most this much of it.
MODEL_SCAN_BYTES = 1 << 20
# OpenAI's metadata limits.
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


class CreateBatch(BaseModel):
    """The body of ``POST /v1/batches`` (openai/types/batch_create_params.py)."""

    # Parameters of OpenAI's that this server does not act on are accepted, not kept
    # (output_expires_after): output files stay until deleted.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1)
    endpoint: ApiEndpoint
    completion_window: str
    metadata: dict[str, str] | None = None

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_of(value)
        return value

    @field_validator("input_file_id")
    @classmethod
    def _file_id(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("holds a NUL")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if any("\x00" in text for pair in value.items() for text in pair):
            raise ValueError("keys and values may not hold a NUL")
        if len(value) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} key-value pairs")
        for key, item in value.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters")
            if len(item) > METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {METADATA_VALUE_CHARS} characters")
        return value


def window_of(completion_window: str) -> timedelta:
    """The completion window as a duration: ``24h``, or an ``<n>s|m|h`` up to 24h."""
    # fullmatch: "$" would let a trailing newline through ("24h\n").
    match = _WINDOW.fullmatch(completion_window)
    window = timedelta(seconds=int(match[1]) * _UNIT_S[match[2]]) if match is not None else None
    if window is None or window > MAX_WINDOW:
        raise ValueError("completion_window must be '24h' (or a shorter '<n>s', '<n>m', '<n>h')")
    return window


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def batch_object(row: api_records.BatchRow, counts: ledger.jobs.JobCounts) -> Batch:
    """The batch as OpenAI's ``Batch`` type has it: its record, and the ledger's counts."""
    errors = (
        BatchErrors(data=[BatchError.model_validate(e) for e in row.errors]) if row.errors else None
    )
    return Batch(
        id=row.batch_id,
        completion_window=row.completion_window,
        created_at=int(row.created_at.timestamp()),
        endpoint=row.endpoint,
        input_file_id=row.input_file_id,
        status=row.status,
        cancelled_at=_ts(row.cancelled_at),
        cancelling_at=_ts(row.cancelling_at),
        completed_at=_ts(row.completed_at),
        error_file_id=row.error_file_id,
        errors=errors,
        expired_at=_ts(row.expired_at),
        expires_at=_ts(row.expires_at),
        failed_at=_ts(row.failed_at),
        finalizing_at=_ts(row.finalizing_at),
        in_progress_at=_ts(row.in_progress_at),
        metadata=row.metadata,
        model=row.model,
        output_file_id=row.output_file_id,
        request_counts=BatchRequestCounts(
            total=counts.total, completed=counts.succeeded, failed=counts.dead
        ),
        usage=BatchUsage(
            input_tokens=counts.prompt_tokens,
            output_tokens=counts.completion_tokens,
            total_tokens=counts.prompt_tokens + counts.completion_tokens,
        ),
    )


async def _with_counts(svc: Services, row: api_records.BatchRow) -> Batch:
    return batch_object(row, await ledger.jobs.job_counts(svc.pool, job_id=row.batch_id))


def model_of(head: bytes, *, whole: bool) -> str | None:
    """The model the first request lines name (``body.model``), read from the first
    bytes of the input; lines that do not parse are left to validation, which fails
    the batch with their line numbers."""
    lines = head.split(b"\n")
    if not whole:
        lines = lines[:-1]  # the last line may be cut
    for line in lines:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        body = request.get("body") if isinstance(request, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model.strip():
            return model
    return None


@router.post("/batches", response_model=Batch)
async def create_batch(body: CreateBatch, project: Project, svc: Svc) -> Batch:
    """Create a batch over an uploaded file and start it."""
    settings = svc.settings
    source = await api_records.get_file(svc.pool, project=project, file_id=body.input_file_id)
    if source is None:
        raise not_found("File", body.input_file_id, param="input_file_id")
    if source.purpose != "batch":
        raise ApiError(
            400,
            f"File {source.file_id} has purpose {source.purpose!r}; a batch reads files "
            "uploaded with purpose 'batch'.",
            param="input_file_id",
            code="invalid_value",
        )
    limit = settings.api_max_requests_per_batch
    if source.lines is not None and source.lines > limit:
        raise ApiError(
            400,
            f"The input file has {source.lines} lines; a batch holds at most {limit} "
            "requests (LLMBATCH_API_MAX_REQUESTS_PER_BATCH).",
            param="input_file_id",
            code="too_many_requests_in_batch",
        )
    head = await asyncio.to_thread(svc.store.read_range, source.object_uri, 0, MODEL_SCAN_BYTES)
    model = model_of(head, whole=source.bytes <= MODEL_SCAN_BYTES)
    if model is None and not head.strip():
        raise ApiError(
            400,
            "The batch input file is empty.",
            param="input_file_id",
            code=openai_validation.EMPTY_FILE,
        )
    if model is None and source.bytes > MODEL_SCAN_BYTES and b"\n" not in head:
        # Validation would refuse it too: a line is at most a job's max_row_bytes.
        raise ApiError(
            400,
            f"Line 1 is longer than the limit of {MODEL_SCAN_BYTES} bytes.",
            param="input_file_id",
            code=openai_validation.LINE_TOO_LARGE,
        )
    if model is None:
        raise ApiError(
            400,
            "No request in the first lines of the input file names a model (body.model).",
            param="input_file_id",
            code="missing_model",
        )
    # An operator's quota for the project (its tenant) may allow fewer batches at once.
    quota = settings.quota(project)
    in_progress_cap = min(
        settings.api_max_batches_in_progress,
        quota.max_concurrent_jobs or settings.api_max_batches_in_progress,
    )
    batch_id = api_layout.new_batch_id()
    window = window_of(body.completion_window)
    spec = JobSpec(
        job_id=batch_id,
        inputs=[source.object_uri],
        input_format=InputFormat.OPENAI,
        model=model,
        output_uri=api_layout.batch_output_uri(settings.s3_bucket),
        shard_size=settings.api_shard_size,
        max_concurrent_shards=settings.api_max_concurrent_shards,
        task=body.endpoint.task,
        # Projects share the workers fairly: each is its batches' tenant.
        tenant=project,
        api_batch=ApiBatch(
            project=project,
            endpoint=body.endpoint,
            completion_window_s=int(window.total_seconds()),
        ),
    )
    # A model routed to an endpoint runs on its remote workers' queue (with those scaled
    # to zero the batch waits there, as it would for a GPU worker), or through the
    # endpoint's Batch API when the route says --serve-via batch.
    try:
        spec = await place(svc.pool, spec)
    except EndpointError as exc:
        raise ApiError(400, str(exc), param="model", code="model_not_available") from None
    if spec.remote_endpoint is None and not await _gpu_model_declared(
        svc, model, body.endpoint.task
    ):
        raise ApiError(
            400,
            f"No worker serves model {model!r}, nor ever did: start a GPU worker for it "
            f"(llm-batch worker gpu --model ... --task {body.endpoint.task}), route it to "
            "a remote endpoint (llm-batch endpoint update NAME --serve-as ...) or name one "
            "that GET /v1/models lists.",
            param="model",
            code="model_not_found",
        )
    record = ApiBatchRecordInput(
        batch_id=batch_id,
        project=project,
        input_file_id=source.file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        window_s=int(window.total_seconds()),
        model=model,
        metadata=body.metadata,
        max_in_progress=in_progress_cap,
    )
    # The workflow writes the record (Update-with-Start): a server that dies anywhere
    # in here leaves either nothing or a batch whose workflow ends it.
    try:
        await asyncio.wait_for(
            start_api_batch(svc.temporal, spec, record, settings=settings), CREATE_WAIT_S
        )
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == FailureType.TOO_MANY_BATCHES:
            setting = (
                "LLMBATCH_API_MAX_BATCHES_IN_PROGRESS"
                if in_progress_cap == settings.api_max_batches_in_progress
                else f"the project's max_concurrent_jobs in {QUOTA_SETTING}"
            )
            raise ApiError(
                429,
                f"This project has {in_progress_cap} batches in progress, the most it may "
                f"have ({setting}); wait for one to finish.",
                type=ErrorType.RATE_LIMIT,
                code="too_many_batches_in_progress",
            ) from None
        log.error("batch %s not recorded: %s", batch_id, cause)
        raise ApiError(
            500, "The batch could not be created; try again.", type=ErrorType.SERVER
        ) from exc
    except TimeoutError:
        # Temporal has the workflow, which writes the record once a CPU worker takes
        # it: answer with the batch as it will be (validating), not an error that
        # would make the caller create it twice.
        log.warning("batch %s: its record not written within %s s", batch_id, CREATE_WAIT_S)
        now = datetime.now(UTC)
        return await _with_counts(
            svc,
            api_records.BatchRow(
                batch_id=batch_id,
                project=project,
                input_file_id=source.file_id,
                endpoint=body.endpoint,
                completion_window=body.completion_window,
                model=model,
                metadata=body.metadata,
                status=BatchStatus.VALIDATING,
                errors=None,
                output_file_id=None,
                error_file_id=None,
                created_at=now,
                expires_at=now + window,
                in_progress_at=None,
                finalizing_at=None,
                completed_at=None,
                failed_at=None,
                expired_at=None,
                cancelling_at=None,
                cancelled_at=None,
            ),
        )
    return await _with_counts(svc, await _batch(svc, project, batch_id))


async def _gpu_model_declared(svc: Services, model: str, task: Task) -> bool:
    """Whether GPU workers serve ``model`` for ``task`` now, or did once: with its
    workers scaled to zero a batch waits for one; only a model no worker ever served
    is refused."""
    settings = svc.settings
    return await model_has_worker(
        svc.temporal, settings, model, task=task, rpc_timeout=timedelta(seconds=BACKEND_TIMEOUT_S)
    ) or await served_models.was_served(svc.pool, task_queue=settings.gpu_task_queue(model, task))


async def _batch(svc: Services, project: str, batch_id: str) -> api_records.BatchRow:
    row = await api_records.get_batch(svc.pool, project=project, batch_id=batch_id)
    if row is None:
        raise not_found("Batch", batch_id)
    return row


@router.get("/batches/{batch_id}", response_model=Batch)
async def get_batch(batch_id: str, project: Project, svc: Svc) -> Batch:
    return await _with_counts(svc, await _batch(svc, project, batch_id))


@router.get("/batches", response_model=CursorPage[Batch])
async def list_batches(
    project: Project,
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> CursorPage[Batch]:
    """The project's batches, newest first."""
    rows, more = await api_records.list_batches(svc.pool, project=project, limit=limit, after=after)
    items = [await _with_counts(svc, r) for r in rows]
    return CursorPage[Batch](**page(items, has_more=more))


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
async def cancel_batch(batch_id: str, project: Project, svc: Svc) -> Batch:
    """Cancel a batch: ``cancelling`` now, ``cancelled`` once its workflow has stopped
    (finished requests are kept and end in its output file)."""
    row = await _batch(svc, project, batch_id)
    if row.status in FINAL_STATUSES:
        raise ApiError(
            400,
            f"Cannot cancel a batch with status {row.status.value!r}.",
            param="batch_id",
            code="batch_not_cancellable",
        )
    await set_batch_status(svc.pool, batch_id=batch_id, status=BatchStatus.CANCELLING)
    # As `llm-batch cancel` does, without waiting: the workflow's own end records
    # `cancelled`, and the caller polls for it.
    try:
        await svc.temporal.get_workflow_handle(batch_id).cancel()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        # No workflow runs it (a record left by a server of before Update-with-Start,
        # or a workflow that ended without its record's end): nothing else will end it.
        log.warning("batch %s has no running workflow: cancelled here", batch_id)
        await set_batch_status(svc.pool, batch_id=batch_id, status=BatchStatus.CANCELLED)
    return await _with_counts(svc, await _batch(svc, project, batch_id))
