"""One interface over the object store (S3 and compatibles) and the local disk.

URIs are ``s3://bucket/key``, ``file:///abs/path`` or plain paths; a glob (``*``,
``?``, ``[``) in the last parts lists matching objects, and a URI ending in ``/``
lists everything under it. Writes are atomic per object (an S3 PUT is; local files
are written beside and renamed), so a retried write replaces and never truncates.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from llmbatch.config import Settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_GLOB_CHARS = ("*", "?", "[")


class StorageError(Exception):
    """A storage failure that retrying will not fix (bad URI, missing object, denied)."""


class InputNotFound(StorageError):
    """Nothing exists at, or matches, a URI."""


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    size: int


class ObjectStore(Protocol):
    def list(self, uri: str) -> list[ObjectInfo]:
        """Objects at, under (trailing ``/``) or matching (glob) ``uri``, sorted by URI."""
        ...

    def size(self, uri: str) -> int: ...

    def read_bytes(self, uri: str) -> bytes: ...

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``."""
        ...

    def open_read(self, uri: str) -> IO[bytes]:
        """A sequential reader that does not load the whole object."""
        ...

    def put_bytes(self, uri: str, data: bytes) -> None: ...

    def put_file(self, uri: str, path: Path) -> None: ...

    def exists(self, uri: str) -> bool: ...

    def delete_prefix(self, uri: str) -> int:
        """Delete every object under ``uri``; return how many."""
        ...


def open_store(uri: str, settings: Settings) -> ObjectStore:
    """The store that serves ``uri``'s scheme."""
    scheme = urlsplit(uri).scheme if "://" in uri else "file"
    if scheme == "s3":
        return S3Store(settings)
    if scheme == "file":
        return LocalStore()
    raise StorageError(f"unsupported URI scheme {scheme!r} in {uri}; use s3://, file:// or a path")


def join(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended, one ``/`` between each."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def _has_glob(text: str) -> bool:
    return any(c in text for c in _GLOB_CHARS)


# --- S3 -----------------------------------------------------------------------------


def _split_s3(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        raise StorageError(f"not an s3://bucket/key URI: {uri}")
    return parts.netloc, parts.path.lstrip("/")


def s3_client(
    settings: Settings,
    *,
    max_attempts: int = 10,
    timeout_s: float | None = None,
    secret_access_key: str | None = None,
) -> S3Client:
    """A boto3 S3 client for the configured store: path-style addressing (what
    S3-compatible servers expect), SigV4, and botocore's ``standard`` retries."""
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        max_pool_connections=32,
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


class S3Store:
    """S3 through boto3, with the ``standard`` retry mode for throttling and 5xx."""

    def __init__(self, settings: Settings) -> None:
        self._client = s3_client(settings)

    def _permanent(self, exc: ClientError, uri: str) -> Exception:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound", "NoSuchBucket"):
            return InputNotFound(f"{uri} does not exist")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(f"access to {uri} denied ({code})")
        return exc  # anything else may be transient: let Temporal retry it

    def list(self, uri: str) -> list[ObjectInfo]:
        bucket, key = _split_s3(uri)
        if _has_glob(key):
            prefix = key[: min(key.index(c) for c in _GLOB_CHARS if c in key)]
            match = key
        elif key.endswith("/") or not key:
            prefix, match = key, None
        else:
            try:
                return [ObjectInfo(uri, self.size(uri))]
            except InputNotFound:
                prefix, match = key + "/", None  # a "folder" without the trailing slash
        found: list[ObjectInfo] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"]
                    if name.endswith("/"):
                        continue
                    if match is not None and not fnmatch.fnmatchcase(name, match):
                        continue
                    found.append(ObjectInfo(f"s3://{bucket}/{name}", obj["Size"]))
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc
        if not found:
            raise InputNotFound(f"no objects match {uri}")
        return sorted(found, key=lambda o: o.uri)

    def size(self, uri: str) -> int:
        bucket, key = _split_s3(uri)
        try:
            return self._client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc

    def read_bytes(self, uri: str) -> bytes:
        bucket, key = _split_s3(uri)
        try:
            return self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        bucket, key = _split_s3(uri)
        try:
            response = self._client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
            )
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc
        return response["Body"].read()

    def open_read(self, uri: str) -> IO[bytes]:
        bucket, key = _split_s3(uri)
        try:
            body = self._client.get_object(Bucket=bucket, Key=key)["Body"]
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc
        return body  # type: ignore[return-value]  # StreamingBody reads like a file

    def put_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = _split_s3(uri)
        try:
            self._client.put_object(Bucket=bucket, Key=key, Body=data)
        except ClientError as exc:
            raise self._permanent(exc, uri) from exc

    def put_file(self, uri: str, path: Path) -> None:
        bucket, key = _split_s3(uri)
        self._client.upload_file(str(path), bucket, key)

    def exists(self, uri: str) -> bool:
        try:
            self.size(uri)
        except InputNotFound:
            return False
        return True

    def delete_prefix(self, uri: str) -> int:
        bucket, prefix = _split_s3(uri)
        deleted = 0
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self._client.delete_objects(Bucket=bucket, Delete={"Objects": keys})  # type: ignore[typeddict-item]
                deleted += len(keys)
        return deleted


# --- local disk ---------------------------------------------------------------------


def _path(uri: str) -> Path:
    if uri.startswith("file://"):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise StorageError(f"file URIs name no host: {uri}")
        return Path(parts.path)
    return Path(uri).expanduser()


class LocalStore:
    """Files on this machine; URIs come back in the form they were given."""

    def list(self, uri: str) -> list[ObjectInfo]:
        path = _path(uri)
        prefix = "file://" if uri.startswith("file://") else ""
        if _has_glob(str(path)):
            matches = [Path(p) for p in glob.glob(str(path), recursive=True)]
        elif path.is_dir():
            matches = [p for p in path.rglob("*")]
        elif path.is_file():
            matches = [path]
        else:
            raise InputNotFound(f"{uri} does not exist")
        found = [
            ObjectInfo(f"{prefix}{p.resolve() if prefix else p}", p.stat().st_size)
            for p in matches
            if p.is_file()
        ]
        if not found:
            raise InputNotFound(f"no files match {uri}")
        return sorted(found, key=lambda o: o.uri)

    def size(self, uri: str) -> int:
        try:
            return _path(uri).stat().st_size
        except FileNotFoundError:
            raise InputNotFound(f"{uri} does not exist") from None

    def read_bytes(self, uri: str) -> bytes:
        try:
            return _path(uri).read_bytes()
        except FileNotFoundError:
            raise InputNotFound(f"{uri} does not exist") from None

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        with self.open_read(uri) as f:
            f.seek(start)
            return f.read(max(end - start, 0))

    def open_read(self, uri: str) -> IO[bytes]:
        try:
            return _path(uri).open("rb")
        except FileNotFoundError:
            raise InputNotFound(f"{uri} does not exist") from None

    def put_bytes(self, uri: str, data: bytes) -> None:
        path = _path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, uri: str, path: Path) -> None:
        self.put_bytes(uri, path.read_bytes())

    def exists(self, uri: str) -> bool:
        return _path(uri).is_file()

    def delete_prefix(self, uri: str) -> int:
        path = _path(uri)
        if not path.exists():
            return 0
        if path.is_file():
            path.unlink()
            return 1
        files = [p for p in path.rglob("*") if p.is_file()]
        for p in files:
            p.unlink()
        for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
            d.rmdir()
        path.rmdir()
        return len(files)
