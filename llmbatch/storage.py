"""One interface over the object store (S3 and compatibles) and the local disk.

URIs are ``s3://bucket/key``, ``file:///abs/path`` or plain paths (relative or
absolute). Keys and paths are taken literally: no percent-decoding, in either scheme.

Listing (:meth:`ObjectStore.list`) takes three kinds of URI:

- a glob (``*``, ``?``, ``[...]``; ``**`` for any depth): the objects it matches.
  ``*`` stops at ``/`` in both schemes, like a shell.
- a folder (``s3://b/data/`` or ``s3://b/data``, a local directory): every object
  under it, at any depth, except hidden ones: names starting with ``.`` or ``_``
  (``_SUCCESS`` markers, temporary files), as Hadoop, Spark and Arrow skip them.
- one object: itself.

Writes are atomic per object (an S3 PUT is; local files are written beside the
target and renamed over it), so a retried write replaces and never truncates.

Errors that retrying cannot fix (bad URI, no such object or bucket, access denied)
raise :class:`StorageError` subclasses with a clear message; anything else from
botocore (5xx, throttling, lost connections) propagates unchanged, after botocore's
own retries, so Temporal retries the activity.
"""

from __future__ import annotations

import copy
import glob as globlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

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

# Re-exported: storage callers take URIs apart with the contract's one parser.
from llmbatch.contract.uris import scheme_of, split_scheme

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_GLOB_CHARS = ("*", "?", "[")
# Named in refusals, so an operator knows which setting to widen.
_ROOTS_SETTING = "LLMBATCH_LOCAL_ROOTS"
_READ_BUFFER = 1 << 20
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


class StorageError(Exception):
    """A storage failure that retrying will not fix (bad URI, missing object, denied)."""


class InputNotFound(StorageError):
    """Nothing exists at, or matches, a URI."""


class BucketNotFound(InputNotFound):
    """The URI's bucket does not exist."""


class OutsideLocalRoots(StorageError):
    """A local path outside the folders workers may use (``Settings.local_roots``)."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object (or local file) and its size in bytes."""

    uri: str
    size: int


class ObjectStore(Protocol):
    """What llm-batch needs from storage; :func:`open_store` gives the one for a URI.

    Implementations are safe to share between threads.
    """

    def list(self, uri: str) -> list[ObjectInfo]:
        """Objects at, under or matching ``uri`` (see the module doc), sorted by URI.

        Raises :class:`InputNotFound`, naming ``uri``, when nothing matches.
        """
        ...

    def size(self, uri: str) -> int:
        """The object's size in bytes."""
        ...

    def read_bytes(self, uri: str) -> bytes:
        """The whole object; for small objects (plans, staging, manifests)."""
        ...

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; shorter if the object ends first."""
        ...

    def open_read(self, uri: str, *, start: int = 0, end: int | None = None) -> BinaryIO:
        """A sequential reader over bytes ``[start, end)`` that never loads them all."""
        ...

    def put_bytes(self, uri: str, data: bytes) -> None:
        """Write (or replace) the object atomically."""
        ...

    def put_file(self, uri: str, path: Path) -> None:
        """Upload a local file (multipart when big), atomically."""
        ...

    def exists(self, uri: str) -> bool: ...

    def check_output(self, uri: str) -> None:
        """Raise :class:`StorageError` if results can never be written under ``uri``
        (a bucket that does not exist, a folder outside the local roots); writes
        nothing, creates nothing."""
        ...

    def delete_prefix(self, uri: str) -> int:
        """Delete the object at ``uri`` and every object under ``uri/``; return how many."""
        ...


def open_store(uri: str, settings: Settings) -> ObjectStore:
    """The store that serves ``uri``'s scheme (an S3 client is costly: reuse stores)."""
    scheme = scheme_of(uri)
    if scheme == "s3":
        return S3Store(settings)
    if scheme == "file":
        return LocalStore(settings.local_roots)
    raise StorageError(f"unsupported URI scheme {scheme!r} in {uri}; use s3://, file:// or a path")


class Stores:
    """One store per scheme, opened on first use and kept (boto3 clients are costly);
    called with a URI, it answers the store that serves it."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._stores: dict[str, ObjectStore] = {}

    def __call__(self, uri: str) -> ObjectStore:
        scheme = scheme_of(uri)
        if scheme not in self._stores:
            self._stores[scheme] = open_store(uri, self._settings)
        return self._stores[scheme]


def join(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended, one ``/`` between each, for every scheme.

    ``join("s3://b/out/", "job", "part-1.jsonl") == "s3://b/out/job/part-1.jsonl"``.
    """
    scheme, rest = split_scheme(uri)
    base = rest.rstrip("/") if scheme is None else f"{scheme}://{rest.rstrip('/')}"
    pieces = [p for part in parts for p in part.split("/") if p]
    for piece in pieces:
        if piece in (".", ".."):
            raise StorageError(f"refusing to join {piece!r} onto {uri}")
    if not pieces:
        return uri
    if not base and not uri.startswith("/"):
        return "/".join(pieces)
    return "/".join([base, *pieces])


def _has_glob(text: str) -> bool:
    return any(c in text for c in _GLOB_CHARS)


def _hidden(relative: str) -> bool:
    """Whether any part of a path below a listed folder is hidden (``.x`` or ``_x``)."""
    return any(part.startswith((".", "_")) for part in relative.split("/") if part)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regex for a shell-style glob over ``/``-separated keys: ``*`` and ``?`` stay
    within one part, ``[...]`` is a character class, a ``**`` part spans any depth."""
    # By hand: pyarrow.fs does no globbing, fnmatch's "*" crosses "/", and the
    # stdlib's glob.translate (these rules) comes only with Python 3.13.
    # fsspec.utils.glob_translate agrees with this, but fsspec is no dependency of
    # ours (only vLLM brings it), and these lines do not pay for one.
    out: list[str] = []
    segments = pattern.split("/")
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment == "**":
            out.append(".*" if last else "(?:[^/]*/)*")
            continue
        i = 0
        while i < len(segment):
            c = segment[i]
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif c == "[":
                close = segment.find("]", i + 2 if segment[i + 1 : i + 2] in ("!", "]") else i + 1)
                if close < 0:
                    out.append(re.escape(c))
                else:
                    body = segment[i + 1 : close]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append("[" + body.replace("\\", "\\\\") + "]")
                    i = close
            else:
                out.append(re.escape(c))
            i += 1
        if not last:
            out.append("/")
    return re.compile("".join(out) + r"\Z", re.DOTALL)


# --- S3 -----------------------------------------------------------------------------


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


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _permanent(exc: ClientError, uri: str) -> Exception:
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
        if _has_glob(key):
            prefix = key[: min(key.index(c) for c in _GLOB_CHARS if c in key)]
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
            elif _hidden(name[len(prefix) :]):
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
            raise _permanent(exc, uri) from exc

    def size(self, uri: str) -> int:
        bucket, key = split_s3(uri)
        try:
            return self._client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except ClientError as exc:
            raise _permanent(exc, uri) from exc

    def read_bytes(self, uri: str) -> bytes:
        bucket, key = split_s3(uri)
        try:
            return self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            raise _permanent(exc, uri) from exc

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        # The reader's ranged GET, so a range whose body drops midway is resumed too.
        if end <= start:
            return b""
        with self.open_read(uri, start=start, end=end) as f:
            return f.read(end - start)

    def open_read(self, uri: str, *, start: int = 0, end: int | None = None) -> BinaryIO:
        raw = _S3Reader(self._client, uri, start=start, end=end)
        return io.BufferedReader(raw, _READ_BUFFER)

    def put_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = split_s3(uri)
        try:
            self._client.put_object(Bucket=bucket, Key=key, Body=data)
        except ClientError as exc:
            raise _permanent(exc, uri) from exc

    def put_file(self, uri: str, path: Path) -> None:
        bucket, key = split_s3(uri)
        try:
            # Multipart above boto3's threshold; S3 shows the object only once complete.
            self._client.upload_file(str(path), bucket, key)
        except boto3.exceptions.S3UploadFailedError as exc:
            cause = exc.__context__
            if isinstance(cause, ClientError):
                error = _permanent(cause, uri)
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
            raise _permanent(exc, uri) from exc

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
                raise _permanent(exc, uri) from exc
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
            raise _permanent(exc, self._uri) from exc
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


# --- local disk ---------------------------------------------------------------------


def local_path(uri: str) -> Path:
    """The path of a ``file://`` URI or a plain path."""
    scheme, rest = split_scheme(uri)
    if scheme is not None:
        host, slash, path = rest.partition("/")
        if scheme.lower() != "file":
            raise StorageError(f"not a file:// URI or path: {uri}")
        if host not in ("", "localhost") or not slash:
            raise StorageError(f"file URIs name no host; use file:///abs/path, not {uri}")
        return Path("/" + path)
    return Path(uri).expanduser()


def _listing_base(path: Path) -> Path:
    """The folder a listing of ``path`` reads: ``path`` itself, or for a glob the
    folder above its first wildcard."""
    text = str(path)
    if not _has_glob(text):
        return path
    head = text[: min(text.index(c) for c in _GLOB_CHARS if c in text)]
    return Path(head.rsplit("/", 1)[0] or "/") if "/" in head else Path(".")


def _os_error(exc: OSError, uri: str) -> Exception:
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return InputNotFound(f"{uri} does not exist")
    if isinstance(exc, PermissionError):
        return StorageError(f"access to {uri} denied: {exc.strerror}")
    if isinstance(exc, IsADirectoryError):
        return StorageError(f"{uri} is a directory, not a file")
    return exc  # EIO and friends: maybe transient


class LocalStore:
    """Files on this machine, under ``roots`` only. Listed URIs keep the form given:
    ``file://`` URIs come back as absolute ``file://`` URIs, plain paths as paths
    (relative stay relative).

    Every path is resolved (``..`` and symlinks) before it is opened, and refused with
    :class:`OutsideLocalRoots` unless it lies under a root: a job spec comes from
    callers this worker need not trust, and must not make it read or write its files.
    """

    def __init__(self, roots: Iterable[Path | str]) -> None:
        self._roots = tuple(Path(r).expanduser().resolve() for r in roots)
        if not self._roots:
            raise ValueError("LocalStore needs at least one root folder ('/' allows all)")

    def _inside(self, path: Path, uri: str) -> Path:
        """``path`` resolved, if it lies under a root; the resolved path is what is
        opened, so a symlink is followed once, here, and not again after the check."""
        resolved = path.resolve(strict=False)
        if not any(resolved.is_relative_to(root) for root in self._roots):
            # The path and the setting, nothing of the file: not even whether it exists.
            raise OutsideLocalRoots(f"{uri} is outside the folders in {_ROOTS_SETTING}")
        return resolved

    def _path(self, uri: str) -> Path:
        return self._inside(local_path(uri), uri)

    def list(self, uri: str) -> list[ObjectInfo]:
        path = local_path(uri)
        as_uri = split_scheme(uri)[0] is not None  # local_path allows only file://
        # The folder the listing reads is checked before anything there is looked at.
        self._inside(_listing_base(path), uri)
        if _has_glob(str(path)):
            # glob skips dot-files for us, as the S3 side's regex does not need to.
            matches = [Path(p) for p in globlib.glob(str(path), recursive=True)]
        elif path.is_dir():
            matches = [p for p in path.rglob("*") if not _hidden(p.relative_to(path).as_posix())]
        elif path.is_file():
            matches = [path]
        elif path.exists():
            raise StorageError(f"{uri} is neither a file nor a directory")
        else:
            raise InputNotFound(f"{uri} does not exist")
        found = []
        for p in matches:
            # A symlink under a root may point anywhere: each file is checked too.
            self._inside(p, str(p))
            try:
                if not p.is_file():
                    continue
                size = p.stat().st_size
            except OSError as exc:
                raise _os_error(exc, str(p)) from exc
            found.append(ObjectInfo(f"file://{p.absolute()}" if as_uri else str(p), size))
        if not found:
            raise InputNotFound(f"no files match {uri}")
        return sorted(found, key=lambda o: o.uri)

    def size(self, uri: str) -> int:
        path = self._path(uri)
        try:
            if path.is_dir():
                raise IsADirectoryError(uri)
            return path.stat().st_size
        except OSError as exc:
            raise _os_error(exc, uri) from exc

    def read_bytes(self, uri: str) -> bytes:
        try:
            return self._path(uri).read_bytes()
        except OSError as exc:
            raise _os_error(exc, uri) from exc

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        with self.open_read(uri, start=start, end=end) as f:
            return f.read()

    def open_read(self, uri: str, *, start: int = 0, end: int | None = None) -> BinaryIO:
        try:
            f = self._path(uri).open("rb")
        except OSError as exc:
            raise _os_error(exc, uri) from exc
        if start:
            f.seek(start)
        if end is None:
            return f
        return io.BufferedReader(_Limited(f, max(end - start, 0)), _READ_BUFFER)

    def put_bytes(self, uri: str, data: bytes) -> None:
        with self._atomic(uri) as f:
            f.write(data)

    def put_file(self, uri: str, path: Path) -> None:
        with self._atomic(uri) as f:
            try:
                src = path.open("rb")
            except OSError as exc:
                raise _os_error(exc, str(path)) from exc
            with src:
                shutil.copyfileobj(src, f, _READ_BUFFER)

    def _atomic(self, uri: str) -> _AtomicFile:
        return _AtomicFile(self._path(uri), uri)

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def check_output(self, uri: str) -> None:
        self._path(uri)

    def delete_prefix(self, uri: str) -> int:
        self._path(uri)
        # Deleted as named, not resolved: a symlink is removed, never what it points at.
        path = local_path(uri)
        if path.is_file() or path.is_symlink():
            path.unlink()
            return 1
        if not path.is_dir():
            return 0
        if path.resolve() == Path(path.resolve().anchor):
            raise StorageError(f"refusing to delete everything under {uri}")
        count = sum(1 for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path)
        return count


class _Limited(io.RawIOBase):
    """At most ``remaining`` bytes of a file, from where it stands."""

    # pyarrow's NativeFile.get_stream(offset, nbytes) would do this, but a local
    # read would then be a pyarrow file for this one case and a Python file for all
    # others; a few lines keep them all plain files, whose OSErrors _os_error sorts.

    def __init__(self, f: BinaryIO, remaining: int) -> None:
        self._f = f
        self._remaining = remaining

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self._f.readinto(view[: min(len(view), self._remaining)])  # type: ignore[attr-defined]
        self._remaining -= n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


class _AtomicFile:
    """A temporary file beside ``path`` that replaces it on a clean exit, else vanishes.

    Its name starts with ``.``, so listings never show it."""

    def __init__(self, path: Path, uri: str) -> None:
        self._path = path
        self._uri = uri
        self._tmp: str | None = None
        self._file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(dir=self._path.parent, prefix=f".{self._path.name}.")
        except OSError as exc:
            raise _os_error(exc, self._uri) from exc
        self._file = os.fdopen(fd, "wb")
        return self._file

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._file is not None and self._tmp is not None
        try:
            if exc_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            if exc_type is None:
                os.chmod(self._tmp, 0o644)  # mkstemp makes it 0600
                os.replace(self._tmp, self._path)
                self._tmp = None
        finally:
            if self._tmp is not None:
                Path(self._tmp).unlink(missing_ok=True)
