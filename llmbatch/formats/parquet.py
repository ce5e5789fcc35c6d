"""Parquet over any object store, read by byte ranges; its values made JSON-ready."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import io
import math
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.formats.detection import FormatError
from llmbatch.storage.base import ObjectStore

_BUFFER = 1 << 20


class RangeFile(io.RawIOBase):
    """A seekable file over ranged reads, so pyarrow reads a Parquet footer and the row
    groups it needs without downloading the whole object."""

    def __init__(self, store: ObjectStore, uri: str, size: int) -> None:
        self._store, self._uri, self._size, self._pos = store, uri, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        if end <= self._pos:
            return 0
        data = self._store.read_range(self._uri, self._pos, end)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def open_parquet(store: ObjectStore, uri: str, size: int) -> pq.ParquetFile:
    """A ParquetFile over ``uri``; a file that is not Parquet is a FormatError."""
    try:
        return pq.ParquetFile(io.BufferedReader(RangeFile(store, uri, size), _BUFFER))
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{uri} is not a readable Parquet file: {exc}") from exc


def row_group_starts(metadata: pq.FileMetaData) -> list[int]:
    """The file row number where each row group starts, plus the total at the end."""
    starts = [0]
    for group in range(metadata.num_row_groups):
        starts.append(starts[-1] + metadata.row_group(group).num_rows)
    return starts


def jsonable(value: Any) -> Any:
    """A Parquet value as JSON can carry it: times as ISO 8601 text, decimals and UUIDs
    as text, durations in seconds, NaN and infinities as None, bytes as UTF-8 text
    (or ``base64:`` text when they are not UTF-8), map entries as ``[key, value]``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode("ascii")
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    return str(value)
