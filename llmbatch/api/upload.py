"""A multipart upload streamed straight into the object store, with bounded memory.

FastAPI's ``UploadFile`` would spool the whole file to a temporary file first (disk the
size of the upload, and the bytes written twice). Instead the request body is fed, as
it arrives, to python-multipart's streaming parser; the file part's bytes go to an S3
multipart upload one part at a time. The server holds about one part
(``Settings.api_upload_part_bytes``) per upload, however large the file; while a part
is being sent the body is not read, so the client is held back by TCP, not buffered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from llmbatch.api.errors import ApiError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

FILE_FIELD = "file"
# Form fields other than the file are small (purpose, expires_after...).
_MAX_FIELD_BYTES = 4096
_MAX_FILENAME_CHARS = 255


@dataclass(slots=True)
class Uploaded:
    """What was received: the form's other fields, the file's name, size and lines."""

    fields: dict[str, str]
    filename: str
    size: int
    lines: int


class ObjectWriter:
    """Writes one object from a stream of chunks: a single PUT when it is smaller than
    one part, else an S3 multipart upload (completed, or aborted on any failure)."""

    def __init__(self, client: S3Client, *, bucket: str, key: str, part_bytes: int) -> None:
        self._client = client
        self._bucket = bucket
        self._key = key
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    async def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= self._part_bytes:
            await self._send_part()

    async def _send_part(self) -> None:
        # The buffer goes to botocore as is and a new one starts: no copy of a part.
        body, self._buffer = self._buffer, bytearray()
        if self._upload_id is None:
            created = await asyncio.to_thread(
                self._client.create_multipart_upload, Bucket=self._bucket, Key=self._key
            )
            self._upload_id = created["UploadId"]
        number = len(self._parts) + 1
        sent = await asyncio.to_thread(
            self._client.upload_part,
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,  # type: ignore[arg-type]  # botocore takes a bytearray as a blob
        )
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    async def finish(self) -> None:
        if self._upload_id is None:
            body, self._buffer = bytes(self._buffer), bytearray()
            await asyncio.to_thread(
                self._client.put_object, Bucket=self._bucket, Key=self._key, Body=body
            )
            return
        if self._buffer:
            await self._send_part()
        await asyncio.to_thread(
            self._client.complete_multipart_upload,
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": self._parts},  # type: ignore[typeddict-item]
        )

    async def abort(self) -> None:
        self._buffer = bytearray()
        if self._upload_id is not None:
            await asyncio.to_thread(
                self._client.abort_multipart_upload,
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
            )


@dataclass(slots=True)
class _Form:
    """python-multipart callbacks: collects the small fields and hands the file part's
    bytes over in ``pending`` (the caller drains it after every parser write)."""

    max_file_bytes: int
    fields: dict[str, bytearray] = field(default_factory=dict)
    pending: list[bytes] = field(default_factory=list)
    filename: str | None = None
    size: int = 0
    newlines: int = 0
    last_byte: int | None = None
    error: ApiError | None = None
    # Set by the parser at the closing boundary: a body without it was cut short.
    ended: bool = False
    _header_name: bytearray = field(default_factory=bytearray)
    _header_value: bytearray = field(default_factory=bytearray)
    _part: str | None = None
    _in_file: bool = False
    _files: int = 0

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_part_data": self._data,
            "on_end": self._end,
        }

    def _end(self) -> None:
        self.ended = True

    def _begin(self) -> None:
        self._part, self._in_file = None, False

    def _header_end(self) -> None:
        name = bytes(self._header_name).decode("latin-1").strip().lower()
        value = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()
        if name != "content-disposition":
            return
        _, params = parse_options_header(value)
        self._part = params.get(b"name", b"").decode("utf-8", "replace")
        if self._part == FILE_FIELD:
            self._in_file = True
            self._files += 1
            if self._files > 1:
                self._fail(ApiError(400, "Send one file per upload.", param=FILE_FIELD))
            raw = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            if any(ord(c) < 0x20 or c == "\x7f" for c in raw):
                # Postgres text holds no NUL, and a name is a label: refused before a
                # byte of the file is stored.
                self._fail(
                    ApiError(
                        400,
                        "The file name may not contain NUL or other control characters.",
                        param=FILE_FIELD,
                        code="invalid_value",
                    )
                )
            # Only the last path segment, as browsers send: the name is a label.
            self.filename = raw.replace("\\", "/").rsplit("/", 1)[-1][:_MAX_FILENAME_CHARS]
        else:
            self.fields.setdefault(self._part, bytearray())

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        if self._in_file:
            chunk = bytes(data[start:end])  # the parser reuses its buffer: copy
            self.size += len(chunk)
            if self.size > self.max_file_bytes:
                self._fail(
                    ApiError(
                        400,
                        f"File is larger than the server's limit of {self.max_file_bytes} "
                        "bytes (LLMBATCH_API_MAX_FILE_BYTES).",
                        param=FILE_FIELD,
                        code="file_too_large",
                    )
                )
                return
            if chunk:
                self.newlines += chunk.count(b"\n")
                self.last_byte = chunk[-1]
                self.pending.append(chunk)
        elif self._part is not None:
            value = self.fields[self._part]
            value.extend(data[start:end])
            if len(value) > _MAX_FIELD_BYTES:
                self._fail(ApiError(400, f"Form field {self._part!r} is too long."))

    def _fail(self, error: ApiError) -> None:
        if self.error is None:
            self.error = error
        self.pending.clear()


async def receive(
    body: AsyncIterator[bytes], *, content_type: str, writer: ObjectWriter, max_file_bytes: int
) -> Uploaded:
    """Parse a multipart body, writing its ``file`` part through ``writer``.

    On any refusal (raised as :class:`ApiError` once the body is read to its end, so
    the client gets the answer instead of a broken pipe) the object is not written.
    """
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(400, "Send the file as multipart/form-data.", param=FILE_FIELD)
    form = _Form(max_file_bytes=max_file_bytes)
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
    try:
        try:
            async for chunk in body:
                parser.write(chunk)
                for piece in form.pending:
                    await writer.write(piece)
                form.pending.clear()
            parser.finalize()
        except MultipartParseError as exc:
            raise ApiError(400, f"The multipart body is malformed: {exc}") from None
        if form.error is not None:
            raise form.error
        if not form.ended:
            # A client or proxy that stopped mid-body: what came is not the whole file.
            raise ApiError(
                400,
                "The multipart body ends before its closing boundary: the upload is "
                "incomplete, and nothing was stored. Send the whole file again.",
                param=FILE_FIELD,
                code="incomplete_upload",
            )
        if form.filename is None:
            raise ApiError(400, "Missing required parameter: 'file'.", param=FILE_FIELD)
        fields = {k: v.decode("utf-8", "replace") for k, v in form.fields.items()}
        return Uploaded(
            fields=fields,
            filename=form.filename,
            size=form.size,
            lines=form.newlines + (1 if form.last_byte not in (None, ord("\n")) else 0),
        )
    except BaseException:
        await writer.abort()
        raise
