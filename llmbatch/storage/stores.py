"""Which store serves a URI: :func:`open_store` by scheme, and :class:`Stores`, one
store per scheme kept for reuse (boto3 clients are costly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmbatch.config import Settings
from llmbatch.contract.uris import scheme_of

if TYPE_CHECKING:
    pass
from llmbatch.storage.base import ObjectStore, StorageError
from llmbatch.storage.local import LocalStore
from llmbatch.storage.s3 import S3Store


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
