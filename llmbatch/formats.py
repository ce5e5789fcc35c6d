"""Input formats: detecting them, splitting inputs into shards, reading shards, writing output.

Planning streams through JSONL and CSV once in chunks (bounded memory whatever the
size) and cuts shards at record boundaries: a CSV record ends at a newline outside
quotes, so quoted multi-line fields stay whole. Parquet shards are row ranges found
from the file's metadata. Reading a shard never raises for a bad row: the row comes
back with an error and its file and line, so one poison row cannot stop a job.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from llmbatch.contracts import InputFormat
from llmbatch.storage import ObjectInfo, ObjectStore

CHUNK_BYTES = 4 << 20
SNIFF_BYTES = 256 << 10
# Output columns holding nested values; Parquet keeps them as JSON text.
_JSON_COLUMNS_KEY = b"llmbatch.json_columns"


class FormatError(ValueError):
    """An input whose format cannot be told or read."""


class ShardPlan(BaseModel):
    """One shard: a record-aligned byte range (JSONL, CSV) or a row range (Parquet)."""

    index: int
    uri: str
    first_row: int  # global ordinal of the shard's first row, across all inputs
    row_count: int
    start: int = 0  # byte range [start, end) for JSONL and CSV
    end: int = 0
    first_line: int = 1  # 1-based line number at ``start``
    header: list[str] | None = None  # CSV column names
    row_offset: int = 0  # Parquet: first row within the file


@dataclass(slots=True)
class SourceRow:
    ordinal: int
    source: str  # "<uri>:line N" or "<uri>:row N"
    fields: dict[str, Any] | None
    error: str | None = None
    error_class: str | None = None


# --- detection ----------------------------------------------------------------------


def detect_format(uri: str, head: bytes) -> InputFormat:
    """Tell the format from the name, then the first bytes; OpenAI batch JSONL by its keys."""
    name = uri.lower()
    if name.endswith((".parquet", ".pq")) or head.startswith(b"PAR1"):
        return InputFormat.PARQUET
    if name.endswith((".csv", ".tsv")):
        return InputFormat.CSV
    first = next((line for line in head.splitlines() if line.strip()), b"")
    try:
        value = json.loads(first)
    except ValueError:
        value = None
    if isinstance(value, dict):
        if {"custom_id", "url", "body"} <= value.keys():
            return InputFormat.OPENAI
        return InputFormat.JSONL
    if name.endswith((".jsonl", ".ndjson", ".json-lines", ".json")):
        return InputFormat.JSONL
    raise FormatError(
        f"cannot tell the format of {uri}: name it .jsonl, .csv or .parquet, or set input_format"
    )


# --- planning -----------------------------------------------------------------------


def plan_shards(
    store_for: Callable[[str], ObjectStore],
    objects: list[ObjectInfo],
    fmt: InputFormat,
    *,
    shard_size: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[ShardPlan]:
    """Shards of at most ``shard_size`` rows over ``objects``; none spans two objects."""
    plans: list[ShardPlan] = []
    first_row = 0
    for obj in objects:
        store = store_for(obj.uri)
        if fmt is InputFormat.PARQUET:
            new = _plan_parquet(store, obj, shard_size=shard_size)
        else:
            new = _plan_lines(
                store, obj, csv_mode=fmt is InputFormat.CSV, shard_size=shard_size,
                chunk_bytes=chunk_bytes,
            )  # fmt: skip
        for plan in new:
            plan.index = len(plans)
            plan.first_row = first_row
            first_row += plan.row_count
            plans.append(plan)
    return plans


class _Readable(Protocol):
    def open_read(self, uri: str) -> IO[bytes]: ...


class _Records:
    """Splits a byte stream into records: lines, or CSV records whose quotes balance."""

    def __init__(self, *, csv_mode: bool) -> None:
        self.csv_mode = csv_mode
        self.in_quotes = False

    def ends_record(self, line: bytes) -> bool:
        if self.csv_mode and line.count(b'"') % 2:
            self.in_quotes = not self.in_quotes
        return not self.in_quotes


def _iter_lines(stream: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(offset, line including its newline) for every line of a chunked stream."""
    offset = 0
    tail = b""
    for chunk in stream:
        data = tail + chunk
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            yield offset, data[start : nl + 1]
            offset += nl + 1 - start
            start = nl + 1
        tail = data[start:]
    if tail:
        yield offset, tail


def _chunks(store: _Readable, uri: str, chunk_bytes: int) -> Iterator[bytes]:
    reader = store.open_read(uri)
    try:
        while chunk := reader.read(chunk_bytes):
            yield chunk
    finally:
        reader.close()


def _plan_lines(
    store: _Readable, obj: ObjectInfo, *, csv_mode: bool, shard_size: int, chunk_bytes: int
) -> list[ShardPlan]:
    plans: list[ShardPlan] = []
    records = _Records(csv_mode=csv_mode)
    header: list[str] | None = None
    record = b""
    record_start = record_line = 0
    line_no = 0
    shard_start, shard_line, rows = 0, 1, 0
    end = 0
    for offset, line in _iter_lines(_chunks(store, obj.uri, chunk_bytes)):
        line_no += 1
        if not record:
            record_start, record_line = offset, line_no
        record += line
        end = offset + len(line)
        if not records.ends_record(line):
            continue
        text, record = record, b""
        if not text.strip():
            continue  # blank lines are no rows
        if csv_mode and header is None:
            header = _csv_header(text, obj.uri)
            shard_start, shard_line = end, line_no + 1
            continue
        if rows == 0:
            shard_start, shard_line = record_start, record_line
        rows += 1
        if rows == shard_size:
            plans.append(_line_plan(obj, shard_start, end, shard_line, rows, header))
            rows = 0
    if record.strip():  # an unterminated quote runs to the end of the file
        if rows == 0:
            shard_start, shard_line = record_start, record_line
        rows += 1
    if rows:
        plans.append(_line_plan(obj, shard_start, end, shard_line, rows, header))
    if csv_mode and header is None:
        raise FormatError(f"{obj.uri} is empty: a CSV input needs a header line")
    return plans


def _line_plan(
    obj: ObjectInfo, start: int, end: int, line: int, rows: int, header: list[str] | None
) -> ShardPlan:
    return ShardPlan(
        index=0, uri=obj.uri, first_row=0, row_count=rows, start=start, end=end,
        first_line=line, header=header,
    )  # fmt: skip


def _csv_header(record: bytes, uri: str) -> list[str]:
    try:
        text = record.decode("utf-8-sig")
        header = next(csv.reader(io.StringIO(text)))
    except (UnicodeDecodeError, StopIteration, csv.Error) as exc:
        raise FormatError(f"{uri}: cannot read the CSV header: {exc}") from exc
    if len(set(header)) != len(header) or not all(h.strip() for h in header):
        raise FormatError(f"{uri}: CSV header has empty or repeated column names: {header}")
    return header


class _RangeFile(io.RawIOBase):
    """A seekable file over ranged reads, so pyarrow reads Parquet footers and row groups
    without downloading whole objects."""

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
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        data = self._store.read_range(self._uri, self._pos, end)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _parquet(store: ObjectStore, obj: ObjectInfo) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(io.BufferedReader(_RangeFile(store, obj.uri, obj.size), 1 << 20))
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{obj.uri} is not a readable Parquet file: {exc}") from exc


def _plan_parquet(store: ObjectStore, obj: ObjectInfo, *, shard_size: int) -> list[ShardPlan]:
    rows = _parquet(store, obj).metadata.num_rows
    return [
        ShardPlan(
            index=0,
            uri=obj.uri,
            first_row=0,
            row_offset=offset,
            row_count=min(shard_size, rows - offset),
        )
        for offset in range(0, rows, shard_size)
    ]


# --- reading ------------------------------------------------------------------------


def read_shard(
    store: ObjectStore, plan: ShardPlan, fmt: InputFormat, *, max_row_bytes: int
) -> Iterator[SourceRow]:
    """The shard's rows in order; a bad row comes back with ``error`` set, never raised."""
    if fmt is InputFormat.PARQUET:
        yield from _read_parquet(store, plan)
        return
    data = store.read_range(plan.uri, plan.start, plan.end)
    yield from _parse_records(
        data, plan, csv_mode=fmt is InputFormat.CSV, max_row_bytes=max_row_bytes
    )


def _parse_records(
    data: bytes, plan: ShardPlan, *, csv_mode: bool, max_row_bytes: int
) -> Iterator[SourceRow]:
    records = _Records(csv_mode=csv_mode)
    ordinal, line_no = plan.first_row, plan.first_line - 1
    record, record_line = b"", 0
    for _, line in _iter_lines([data]):
        line_no += 1
        if not record:
            record_line = line_no
        record += line
        if not records.ends_record(line):
            continue
        text, record = record, b""
        if not text.strip():
            continue
        yield _row(text, plan, ordinal, record_line, csv_mode, max_row_bytes)
        ordinal += 1
    if record.strip():
        yield _row(record, plan, ordinal, record_line, csv_mode, max_row_bytes)


def _row(
    text: bytes, plan: ShardPlan, ordinal: int, line: int, csv_mode: bool, max_row_bytes: int
) -> SourceRow:
    source = f"{plan.uri}:line {line}"

    def bad(error_class: str, message: str) -> SourceRow:
        return SourceRow(ordinal, source, None, message, error_class)

    if len(text) > max_row_bytes:
        return bad("RowTooLarge", f"row is over the {max_row_bytes}-byte limit")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad("InvalidRow", f"row is not valid UTF-8: {exc.reason} at byte {exc.start}")
    if not csv_mode:
        try:
            value = json.loads(decoded)
        except ValueError as exc:
            return bad("InvalidRow", f"row is not valid JSON: {exc}")
        if not isinstance(value, dict):
            return bad("InvalidRow", f"row is a JSON {type(value).__name__}, not an object")
        return SourceRow(ordinal, source, value)
    header = plan.header or []
    try:
        values = next(csv.reader(io.StringIO(decoded)))
    except (csv.Error, StopIteration) as exc:
        return bad("InvalidRow", f"row is not valid CSV: {exc}")
    if len(values) != len(header):
        return bad("InvalidRow", f"row has {len(values)} fields, the header {len(header)}")
    return SourceRow(ordinal, source, dict(zip(header, values, strict=True)))


def _read_parquet(store: ObjectStore, plan: ShardPlan) -> Iterator[SourceRow]:
    info = ObjectInfo(plan.uri, store.size(plan.uri))
    pf = _parquet(store, info)
    want_start, want_end = plan.row_offset, plan.row_offset + plan.row_count
    group_start = 0
    ordinal = plan.first_row
    for group in range(pf.metadata.num_row_groups):
        group_rows = pf.metadata.row_group(group).num_rows
        group_end = group_start + group_rows
        if group_end > want_start and group_start < want_end:
            table = pf.read_row_group(group)
            lo = max(want_start, group_start) - group_start
            hi = min(want_end, group_end) - group_start
            for offset, fields in enumerate(table.slice(lo, hi - lo).to_pylist()):
                row_no = group_start + lo + offset + 1
                yield SourceRow(ordinal, f"{plan.uri}:row {row_no}", fields)
                ordinal += 1
        group_start = group_end


def field_names(
    store: ObjectStore, obj: ObjectInfo, fmt: InputFormat, *, max_rows: int = 20
) -> set[str]:
    """Field names of an input, from its CSV header, Parquet schema or first JSON rows."""
    if fmt is InputFormat.PARQUET:
        return set(_parquet(store, obj).schema_arrow.names)
    head = store.read_range(obj.uri, 0, min(obj.size, SNIFF_BYTES))
    if obj.size > SNIFF_BYTES:
        head = head[: head.rfind(b"\n") + 1]  # only whole lines
    if fmt is InputFormat.CSV:
        plans = _plan_lines(
            _BytesStore(head), obj, csv_mode=True, shard_size=1, chunk_bytes=SNIFF_BYTES
        )
        return set(plans[0].header or []) if plans else set()
    names: set[str] = set()
    seen = 0
    for line in head.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            names |= value.keys()
        seen += 1
        if seen >= max_rows:
            break
    return names


class _BytesStore:
    """Just enough of a store to plan over bytes already in memory."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def open_read(self, uri: str) -> io.BytesIO:
        return io.BytesIO(self._data)


# --- output -------------------------------------------------------------------------


def write_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as JSONL: UTF-8, one compact object a line."""
    return b"".join(
        json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for row in rows
    )


def read_jsonl_bytes(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.splitlines():
        if line.strip():
            yield json.loads(line)


def write_parquet(rows: list[dict[str, Any]]) -> bytes:
    """Rows as Parquet; nested values (dicts, lists) are stored as JSON text columns."""
    nested = sorted({k for row in rows for k, v in row.items() if isinstance(v, dict | list)})
    flat = [
        {k: (json.dumps(v, ensure_ascii=False) if k in nested and v is not None else v)
         for k, v in row.items()}
        for row in rows
    ]  # fmt: skip
    table = pa.Table.from_pylist(flat)
    table = table.replace_schema_metadata({_JSON_COLUMNS_KEY: ",".join(nested).encode()})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def read_parquet_bytes(data: bytes) -> Iterator[dict[str, Any]]:
    table = pq.read_table(io.BytesIO(data))
    metadata = table.schema.metadata or {}
    nested = [c for c in metadata.get(_JSON_COLUMNS_KEY, b"").decode().split(",") if c]
    for row in table.to_pylist():
        for column in nested:
            if isinstance(row.get(column), str):
                row[column] = json.loads(row[column])
        yield row
