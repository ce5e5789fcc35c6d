"""The S3 (and compatibles) store: listing with globs, ranged and streaming reads that
resume, atomic puts, and botocore errors turned into :class:`StorageError` where
retrying cannot help.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import boto3
import boto3.exceptions
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
)

from llmbatch.config import Settings
from llmbatch.contract.uris import scheme_of, split_scheme

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
from llmbatch.storage.base import (
    READ_BUFFER,
    BucketNotFound,
    InputNotFound,
    ObjectInfo,
    StorageError,
)
from llmbatch.storage.globbing import GLOB_CHARS, glob_regex, has_glob, hidden

# How often a streaming S3 read reopens the object at its position after the
# connection drops mid-body (botocore retries requests, not bodies).
_STREAM_RESUMES = 5


_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchBucket"})


_PERMANENT_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidBucketName",
        "InvalidObjectState",
        "KeyTooLongError",
        "InvalidArgument",
        "400",
        "PreconditionFailed",
        "412",
    }
)


def split_s3(uri: str, *, need_key: bool = True) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://`` URI."""
    bucket, _, key = split_scheme(uri)[1].partition("/")
    if scheme_of(uri) != "s3" or not bucket:
        raise StorageError(f"not an s3://bucket/key URI: {uri}")
    if need_key and not key:
        raise StorageError(f"{uri} names a bucket, not an object")
    return bucket, key


def s3_client(
    settings: Settings,
    *,
    max_attempts: int = 10,
    timeout_s: float | None = None,
    secret_access_key: str | None = None,
) -> S3Client:
    """A boto3 S3 client for the configured store: path-style addressing (what
    S3-compatible servers expect), SigV4, and botocore's ``standard`` retries.

    Checksums only where S3 requires them (botocore's behaviour before 1.36): its
    default CRC32 of every upload and download cost a quarter of the CPU of a 3 MB put
    and get here, and some S3-compatible servers refuse the headers it sends. TLS
    (which authenticates every byte) and the store's own checksums remain.
    """
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        max_pool_connections=32,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    if timeout_s is not None:
        config = config.merge(Config(connect_timeout=timeout_s, read_timeout=timeout_s))
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id.get_secret_value(),
        aws_secret_access_key=secret_access_key or settings.s3_secret_access_key.get_secret_value(),
        config=config,
    )


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def permanent_error(exc: ClientError, uri: str) -> Exception:
    """The StorageError for a permanent S3 error, or ``exc`` itself for a transient one."""
    code = _error_code(exc)
    if code in _NOT_FOUND_CODES:
        if code == "NoSuchBucket":
            bucket = split_s3(uri, need_key=False)[0]
            return BucketNotFound(f"{uri} does not exist: there is no bucket {bucket!r}")
        return InputNotFound(f"{uri} does not exist")
    if code in _PERMANENT_CODES:
        message = exc.response.get("Error", {}).get("Message") or code
        return StorageError(f"{uri}: {code}: {message}")
    # 5xx, throttling, ...: transient, let Temporal retry. A copy, not ``exc`` itself:
    # callers raise the result ``from exc``, and an exception that is its own cause
    # sends Temporal's failure converter into endless recursion (the error is lost).
    return copy.copy(exc)


class S3Store:
    """S3 through boto3, with the ``standard`` retry mode for throttling and 5xx."""

    # boto3, not pyarrow.fs.S3FileSystem: pyarrow reports every S3 failure as a bare
    # OSError with a message ("AWS Error NETWORK_CONNECTION during HeadObject ..."),
    # so telling permanent (StorageError) from transient (Temporal retries) would come
    # down to matching text; and its ranged reads pin no ETag, so an object replaced
    # mid-scan would go unnoticed (see _S3Reader).

    def __init__(self, settings: Settings, *, client: S3Client | None = None) -> None:
        self._client = client or s3_client(settings)

    @property
    def client(self) -> S3Client:
        return self._client

    def list(self, uri: str) -> list[ObjectInfo]:
        bucket, key = split_s3(uri, need_key=False)
        if has_glob(key):
            prefix = key[: min(key.index(c) for c in GLOB_CHARS if c in key)]
            match: re.Pattern[str] | None = glob_regex(key)
        elif key.endswith("/") or not key:
            prefix, match = key, None
        else:
            try:
                return [ObjectInfo(uri, self.size(uri))]
            except BucketNotFound:
                raise
            except InputNotFound:
                prefix, match = key + "/", None  # a "folder" named without its slash
        found: list[ObjectInfo] = []
        for name, size in self._keys(uri, bucket, prefix):
            if name.endswith("/"):
                continue  # folder markers some tools create
            if match is not None:
                if not match.match(name):
                    continue
            elif hidden(name[len(prefix) :]):
                continue
            found.append(ObjectInfo(f"s3://{bucket}/{name}", size))
        if not found:
            raise InputNotFound(f"no objects match {uri}")
        return sorted(found, key=lambda o: o.uri)

    def _keys(self, uri: str, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"], obj["Size"]
        except ClientError as exc:
            raise permanent_error(exc, uri) from exc

    def size(self, uri: str) -> int:
        bucket, key = split_s3(uri)
        try:
            return self._client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except ClientError as exc:
            raise permanent_error(exc, uri) from exc

    def read_bytes(self, uri: str) -> bytes:
        bucket, key = split_s3(uri)
        try:
            return self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            raise permanent_error(exc, uri) from exc

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        # The reader's ranged GET, so a range whose body drops midway is resumed too.
        if end <= start:
            return b""
        with self.open_read(uri, start=start, end=end) as f:
            return f.read(end - start)

    def open_read(self, uri: str, *, start: int = 0, end: int | None = None) -> BinaryIO:
        raw = _S3Reader(self._client, uri, start=start, end=end)
        return io.BufferedReader(raw, READ_BUFFER)

    def put_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = split_s3(uri)
        try:
            self._client.put_object(Bucket=bucket, Key=key, Body=data)
        except ClientError as exc:
            raise permanent_error(exc, uri) from exc

    def put_file(self, uri: str, path: Path) -> None:
        bucket, key = split_s3(uri)
        try:
            # Multipart above boto3's threshold; S3 shows the object only once complete.
            self._client.upload_file(str(path), bucket, key)
        except boto3.exceptions.S3UploadFailedError as exc:
            cause = exc.__context__
            if isinstance(cause, ClientError):
                error = permanent_error(cause, uri)
                if isinstance(error, StorageError):
                    raise error from exc
            raise

    def exists(self, uri: str) -> bool:
        try:
            self.size(uri)
        except InputNotFound:
            return False
        return True

    def check_output(self, uri: str) -> None:
        bucket, _ = split_s3(uri, need_key=False)
        try:
            self._client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            # A HEAD has no body: a missing bucket is a bare 404, not NoSuchBucket.
            code = _error_code(exc)
            if code in _NOT_FOUND_CODES:
                raise BucketNotFound(f"bucket {bucket!r} does not exist") from exc
            if code in ("403", "AccessDenied"):
                # The bucket exists; credentials allowed to write under a prefix may
                # still not be allowed to HEAD the bucket. The writes will tell.
                return
            raise permanent_error(exc, uri) from exc

    def delete(self, uri: str) -> None:
        bucket, key = split_s3(uri)
        try:
            # S3 answers 204 whether or not the key existed.
            self._client.delete_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            raise permanent_error(exc, uri) from exc

    def delete_prefix(self, uri: str) -> int:
        bucket, key = split_s3(uri, need_key=False)
        if not key.strip("/"):
            raise StorageError(f"refusing to delete everything in bucket {bucket!r} ({uri})")
        folder = key if key.endswith("/") else key + "/"
        names = [name for name, _ in self._keys(uri, bucket, folder)]
        if not key.endswith("/") and self.exists(uri):
            names.append(key)
        for i in range(0, len(names), 1000):  # the DeleteObjects limit
            batch = [{"Key": name} for name in names[i : i + 1000]]
            try:
                response = self._client.delete_objects(
                    Bucket=bucket,
                    Delete={"Objects": batch, "Quiet": True},  # type: ignore[typeddict-item]
                )
            except ClientError as exc:
                raise permanent_error(exc, uri) from exc
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} object(s) under {uri}, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
        return len(names)


class _S3Reader(io.RawIOBase):
    """A GET body read sequentially; if the connection drops mid-body, it asks again
    for the rest (``Range`` from where it stopped, ``If-Match`` the same ETag), so a
    long scan survives a blip without starting over."""

    def __init__(self, client: S3Client, uri: str, *, start: int, end: int | None) -> None:
        self._client = client
        self._uri = uri
        self._bucket, self._key = split_s3(uri)
        self._pos = start
        self._end = end
        self._etag: str | None = None
        self._body: Any = None
        self._resumes = 0
        if end is None or end > start:
            self._open()

    def _open(self) -> None:
        args: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._pos > 0 or self._end is not None:
            last = "" if self._end is None else str(self._end - 1)
            args["Range"] = f"bytes={self._pos}-{last}"
        if self._etag is not None:
            args["IfMatch"] = self._etag
        try:
            response = self._client.get_object(**args)
        except ClientError as exc:
            if _error_code(exc) in ("InvalidRange", "416"):
                # Starts at or past the end: nothing to read, as from a file there.
                self._body = None
                self._end = self._pos
                return
            if _error_code(exc) in ("PreconditionFailed", "412"):
                raise StorageError(f"{self._uri} changed while it was being read") from exc
            raise permanent_error(exc, self._uri) from exc
        self._etag = response.get("ETag")
        self._body = response["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view)
        if self._end is not None:
            want = min(want, self._end - self._pos)
        if want <= 0 or self._body is None:
            return 0
        while True:
            try:
                data = self._body.read(want)
                break
            except (IncompleteReadError, HTTPClientError, ConnectionError):
                # A dropped or timed-out connection mid-body (ResponseStreamingError,
                # ReadTimeoutError, a short body): ask again for the rest.
                self._resumes += 1
                if self._resumes > _STREAM_RESUMES:
                    raise
                self._close_body()
                self._open()
                if self._body is None:
                    return 0
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _close_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # closing a broken connection may fail too; it is gone anyway
                pass
            self._body = None

    def close(self) -> None:
        self._close_body()
        super().close()
