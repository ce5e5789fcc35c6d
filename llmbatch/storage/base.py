"""The object-store interface every backend implements, its errors, and URI joining.

Errors that retrying cannot fix (bad URI, no such object or bucket, access denied)
raise :class:`StorageError` subclasses with a clear message; anything else from a
backend (5xx, throttling, lost connections) propagates unchanged, so Temporal retries
the activity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from llmbatch.contract.uris import split_scheme
from llmbatch.errors import LlmBatchError

if TYPE_CHECKING:
    pass


READ_BUFFER = 1 << 20


class StorageError(LlmBatchError):
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

    def delete(self, uri: str) -> None:
        """Delete the object at ``uri``; nothing happens if there is none (one request,
        where :meth:`delete_prefix` lists first)."""
        ...

    def delete_prefix(self, uri: str) -> int:
        """Delete the object at ``uri`` and every object under ``uri/``; return how many."""
        ...


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
