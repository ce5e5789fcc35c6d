"""``/v1/files``: upload, list, get, download, delete; a key sees its project's only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, BinaryIO, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from llmbatch.api.auth import project_of
from llmbatch.api.deps import Services, services
from llmbatch.api.errors import ApiError, not_found
from llmbatch.api.objects import CursorPage, FileDeleted, FileObject, page
from llmbatch.api.upload import ObjectWriter, receive
from llmbatch.ledger import api_layout, api_records
from llmbatch.storage.s3 import split_s3

router = APIRouter()

Project = Annotated[str, Depends(project_of)]
Svc = Annotated[Services, Depends(services)]
UPLOAD_PURPOSES = ("batch",)
# Downloads stream in pieces of this size: memory per download stays at about one.
DOWNLOAD_CHUNK = 1 << 20


def file_object(row: api_records.FileRow) -> FileObject:
    return FileObject(
        id=row.file_id,
        bytes=row.bytes,
        created_at=int(row.created_at.timestamp()),
        filename=row.filename,
        purpose=row.purpose,  # type: ignore[arg-type]  # batch | batch_output, by the table
    )


@router.post("/files", response_model=FileObject)
async def upload_file(request: Request, project: Project, svc: Svc) -> FileObject:
    """Upload a file (multipart: ``file`` and ``purpose`` = ``batch``), streamed to the
    object store as it arrives."""
    settings = svc.settings
    file_id = api_layout.new_file_id()
    uri = api_layout.file_uri(settings.s3_bucket, file_id)
    bucket, key = split_s3(uri)
    writer = ObjectWriter(
        svc.store.client, bucket=bucket, key=key, part_bytes=settings.api_upload_part_bytes
    )
    uploaded = await receive(
        request.stream(),
        content_type=request.headers.get("content-type", ""),
        writer=writer,
        max_file_bytes=settings.api_max_file_bytes,
    )
    try:
        purpose = uploaded.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(
                400,
                f"Invalid purpose {purpose!r}: this server takes files with purpose 'batch'.",
                param="purpose",
                code="invalid_value",
            )
        await writer.finish()
    except BaseException:
        await writer.abort()
        raise
    row = await api_records.insert_file(
        svc.pool,
        file_id=file_id,
        project=project,
        purpose="batch",
        filename=uploaded.filename,
        size=uploaded.size,
        object_uri=uri,
        lines=uploaded.lines,
    )
    return file_object(row)


@router.get("/files", response_model=CursorPage[FileObject])
async def list_files(
    project: Project,
    svc: Svc,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> CursorPage[FileObject]:
    """The project's files, newest first (``order=asc``: oldest first)."""
    rows, more = await api_records.list_files(
        svc.pool, project=project, limit=limit, after=after, purpose=purpose, order=order
    )
    return CursorPage[FileObject](**page([file_object(r) for r in rows], has_more=more))


async def _file(svc: Services, project: str, file_id: str) -> api_records.FileRow:
    row = await api_records.get_file(svc.pool, project=project, file_id=file_id)
    if row is None:
        raise not_found("File", file_id)
    return row


@router.get("/files/{file_id}", response_model=FileObject)
async def get_file(file_id: str, project: Project, svc: Svc) -> FileObject:
    return file_object(await _file(svc, project, file_id))


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, project: Project, svc: Svc) -> StreamingResponse:
    """The file's bytes, streamed from the object store."""
    row = await _file(svc, project, file_id)
    # Opened before the answer starts: a missing object is an error, not a cut body.
    reader = await asyncio.to_thread(svc.store.open_read, row.object_uri)
    return StreamingResponse(
        _chunks(reader),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(row.bytes),
            "Content-Disposition": f'attachment; filename="{row.file_id}.jsonl"',
        },
    )


async def _chunks(reader: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(reader.read, DOWNLOAD_CHUNK):
            yield chunk
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(reader.close)


@router.delete("/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, project: Project, svc: Svc) -> FileDeleted:
    """Delete the file and its bytes; refused while an unfinished batch reads it."""
    await _file(svc, project, file_id)
    row = await api_records.delete_file(svc.pool, project=project, file_id=file_id)
    if row is None:
        raise ApiError(
            400,
            f"File {file_id} is the input of a batch that has not finished; cancel the "
            "batch or wait for it, then delete the file.",
            param="file_id",
            code="file_in_use",
        )
    bucket, key = split_s3(row.object_uri)
    await asyncio.to_thread(svc.store.client.delete_object, Bucket=bucket, Key=key)
    return FileDeleted(id=file_id, deleted=True)
