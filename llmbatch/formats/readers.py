"""Reading a shard's rows. A bad row never raises: it comes back with its error and
its place (file and line), so one poison row cannot stop a job."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pyarrow as pa

from llmbatch.contract.spec import InputFormat
from llmbatch.contract.states import ErrorClass
from llmbatch.formats.detection import (
    SNIFF_BYTES,
    UTF8_BOM,
    FormatError,
    csv_delimiter,
    first_json_object,
)
from llmbatch.formats.parquet import jsonable, open_parquet, row_group_starts
from llmbatch.formats.scanning import iter_chunks, scan_records
from llmbatch.formats.shards import CHUNK_BYTES, ShardPlan, parse_header
from llmbatch.storage.base import ObjectInfo, ObjectStore, StorageError

MAX_ROW_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 1024


@dataclass(slots=True)
class SourceRow:
    """One input row; ``fields`` is None when the row is unreadable, and then
    ``error``/``error_class`` say why."""

    ordinal: int  # position across all inputs, from 0
    source: str  # "<uri>:line N" (JSONL, CSV) or "<uri>:row N" (Parquet), 1-based
    fields: dict[str, Any] | None
    error: str | None = None
    error_class: ErrorClass | None = None


class InputChanged(StorageError):
    """The input is not what was planned (it was replaced or changed since)."""


def read_shard(
    store: ObjectStore,
    plan: ShardPlan,
    fmt: InputFormat,
    *,
    max_row_bytes: int = MAX_ROW_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[SourceRow]:
    """The shard's ``plan.row_count`` rows in order, streamed.

    Rows over ``max_row_bytes`` (without the newline; Parquet: as JSON), invalid UTF-8
    or JSON, JSON that is not an object, and CSV records with the wrong number of
    fields come back with ``error_class`` ``RowTooLarge`` or ``InvalidRow``. Raises
    :class:`InputChanged` if the object changed since planning, :class:`FormatError`
    for a Parquet file that cannot be decoded.
    """
    if plan.object_size is not None:
        size = store.size(plan.uri)
        if size != plan.object_size:
            raise InputChanged(
                f"{plan.uri} is {size} bytes, not the {plan.object_size} it was when the "
                "job was planned; inputs must not change while a job runs"
            )
    if fmt is InputFormat.PARQUET:
        rows = _read_parquet(store, plan, max_row_bytes=max_row_bytes)
    else:
        rows = _read_records(
            store, plan, csv_mode=fmt is InputFormat.CSV, max_row_bytes=max_row_bytes,
            chunk_bytes=chunk_bytes,
        )  # fmt: skip
    count = 0
    for row in rows:
        count += 1
        yield row
    if count != plan.row_count:
        raise InputChanged(
            f"{plan.uri}: shard {plan.index} holds {count} rows, not the {plan.row_count} "
            "planned; the input changed since the job was planned"
        )


def _read_records(
    store: ObjectStore, plan: ShardPlan, *, csv_mode: bool, max_row_bytes: int, chunk_bytes: int
) -> Iterator[SourceRow]:
    if csv_mode:
        # csv refuses fields over its limit (128 KiB by default): allow a whole row.
        csv.field_size_limit(max(csv.field_size_limit(), max_row_bytes))
    chunks = iter_chunks(store.open_read(plan.uri, start=plan.start, end=plan.end), chunk_bytes)
    records = scan_records(
        chunks,
        csv_delimiter=plan.delimiter if csv_mode else None,
        offset=plan.start,
        line=plan.first_line,
        keep_bytes=max_row_bytes + 2,  # room for the record's own "\r\n"
    )
    ordinal = plan.first_row
    for record in records:
        if record.blank:
            continue
        source = f"{plan.uri}:line {record.line}"
        fields, error_class, error = _parse(
            record.data,
            size=record.end - record.start,
            header=plan.header if csv_mode else None,
            delimiter=plan.delimiter,
            max_row_bytes=max_row_bytes,
        )
        yield SourceRow(ordinal, source, fields, error, error_class)
        ordinal += 1


_decode_json = msgspec.json.Decoder().decode


def _parse(
    data: bytes | None,
    *,
    size: int,
    header: list[str] | None,
    delimiter: str,
    max_row_bytes: int,
) -> tuple[dict[str, Any] | None, ErrorClass | None, str | None]:
    """(fields, error class, error) for one record's bytes."""
    if data is not None:
        data = data[:-1] if data.endswith(b"\n") else data
        data = data[:-1] if data.endswith(b"\r") else data
        size = len(data)
    if data is None or size > max_row_bytes:
        return (
            None,
            ErrorClass.ROW_TOO_LARGE,
            f"row is over the {max_row_bytes:,}-byte limit ({size:,} bytes)",
        )
    if header is None:
        # The common case in C; what msgspec refuses (bad UTF-8, NaN, numbers past a
        # float's range, lone surrogates) takes json's path below, with its rules and words.
        try:
            value = _decode_json(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            pass
        else:
            if isinstance(value, dict):
                return value, None, None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            None,
            ErrorClass.INVALID_ROW,
            f"row is not valid UTF-8: {exc.reason} at byte {exc.start}",
        )
    if header is None:
        try:
            value = json.loads(text)
        except ValueError as exc:
            return None, ErrorClass.INVALID_ROW, f"row is not valid JSON: {exc}"
        if not isinstance(value, dict):
            return None, ErrorClass.INVALID_ROW, f"row is a JSON {_json_type(value)}, not an object"
        return value, None, None
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True))
    except csv.Error as exc:
        return None, ErrorClass.INVALID_ROW, f"row is not valid CSV: {exc}"
    if len(rows) != 1:
        return (
            None,
            ErrorClass.INVALID_ROW,
            f"row is not valid CSV: it parses as {len(rows)} records",
        )
    values = rows[0]
    if len(values) != len(header):
        return (
            None,
            ErrorClass.INVALID_ROW,
            f"row has {len(values)} fields, the header {len(header)}",
        )
    return dict(zip(header, values, strict=True)), None, None


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _read_parquet(
    store: ObjectStore, plan: ShardPlan, *, max_row_bytes: int
) -> Iterator[SourceRow]:
    size = plan.object_size if plan.object_size is not None else store.size(plan.uri)
    pf = open_parquet(store, plan.uri, size)
    starts = row_group_starts(pf.metadata)
    groups = list(range(plan.row_group_start, plan.row_group_end))
    if not groups:  # a plan from before row-group ranges: read from the footer
        groups = [g for g in range(len(starts) - 1) if starts[g + 1] > plan.row_offset]
    file_row = starts[groups[0]] if groups else 0
    skip = plan.row_offset - file_row
    left = plan.row_count
    ordinal = plan.first_row
    try:
        batches = pf.iter_batches(
            batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, use_threads=False
        )
        for batch in batches:
            if left <= 0:
                break
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                file_row += batch.num_rows
                continue
            rows = batch.slice(skip, left).to_pylist()
            file_row += skip
            skip = 0
            for raw in rows:
                file_row += 1
                source = f"{plan.uri}:row {file_row}"
                fields = {str(k): jsonable(v) for k, v in raw.items()}
                row_bytes = len(json.dumps(fields, ensure_ascii=False).encode())
                if row_bytes > max_row_bytes:
                    message = (
                        f"row is {row_bytes:,} bytes as JSON, over the {max_row_bytes:,}-byte limit"
                    )
                    yield SourceRow(ordinal, source, None, message, ErrorClass.ROW_TOO_LARGE)
                else:
                    yield SourceRow(ordinal, source, fields)
                ordinal += 1
            left -= len(rows)
    except pa.ArrowException as exc:
        raise FormatError(f"{plan.uri}: cannot decode Parquet data: {exc}") from exc


def field_names(
    store: ObjectStore, obj: ObjectInfo, fmt: InputFormat, *, max_rows: int = 20
) -> set[str]:
    """Field names of an input: its CSV header, Parquet schema, or the keys of its first
    ``max_rows`` JSON objects (empty when none can be read)."""
    if fmt is InputFormat.PARQUET:
        return set(open_parquet(store, obj.uri, obj.size).schema_arrow.names)
    head = store.read_range(obj.uri, 0, min(obj.size, SNIFF_BYTES))
    if head.startswith(UTF8_BOM):
        head = head[len(UTF8_BOM) :]
    if fmt is InputFormat.CSV:
        delimiter = csv_delimiter(obj.uri)
        cut = obj.size > SNIFF_BYTES
        for record in scan_records([head], csv_delimiter=delimiter, keep_bytes=len(head)):
            if record.blank:
                continue
            if record.data is None or (cut and record.end == len(head)):
                return set()  # the header goes on past what was read: unknown
            return set(parse_header(record.data, obj.uri, delimiter))
        return set()
    names: set[str] = set()
    lines = [line for line in head.split(b"\n") if line.strip()]
    if obj.size > SNIFF_BYTES and not head.endswith(b"\n"):
        lines = lines[:-1]  # the last line was cut off
    for line in lines[:max_rows]:
        value = first_json_object(line)
        if value is not None:
            names |= value.keys()
    return names


def has_rows(store: ObjectStore, obj: ObjectInfo, fmt: InputFormat) -> bool:
    """Whether an input holds at least one row (a CSV header alone is none), from its
    first bytes (Parquet: its footer). True when those do not settle it: the planner,
    which reads everything, counts the rows anyway."""
    if fmt is InputFormat.PARQUET:
        return open_parquet(store, obj.uri, obj.size).metadata.num_rows > 0
    head = store.read_range(obj.uri, 0, min(obj.size, SNIFF_BYTES))
    if head.startswith(UTF8_BOM):
        head = head[len(UTF8_BOM) :]
    delimiter = csv_delimiter(obj.uri) if fmt is InputFormat.CSV else None
    needed = 2 if delimiter is not None else 1  # a CSV's first record is its header
    for record in scan_records([head], csv_delimiter=delimiter):
        if not record.blank:
            needed -= 1
            if not needed:
                return True
    return obj.size > SNIFF_BYTES


def sample_objects(
    store: ObjectStore, obj: ObjectInfo, *, max_rows: int = 20
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for the JSON objects among the first ``max_rows`` lines of
    a JSON-lines input, for checks that refuse a job before any work."""
    head = store.read_range(obj.uri, 0, min(obj.size, SNIFF_BYTES))
    if head.startswith(UTF8_BOM):
        head = head[len(UTF8_BOM) :]
    lines = head.split(b"\n")
    if obj.size > SNIFF_BYTES:
        lines = lines[:-1]  # the last line was cut off
    found: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if len(found) == max_rows:
            break
        value = first_json_object(line) if line.strip() else None
        if value is not None:
            found.append((number, dict(value)))
    return found


def sample_row(
    store: ObjectStore, obj: ObjectInfo, fmt: InputFormat, *, max_row_bytes: int = MAX_ROW_BYTES
) -> dict[str, Any] | None:
    """The first readable row of an input, read from its first bytes (Parquet: its
    first row), to try the prompt on before any work; None when there is none there."""
    if fmt is InputFormat.PARQUET:
        pf = open_parquet(store, obj.uri, obj.size)
        for batch in pf.iter_batches(batch_size=1, use_threads=False):
            for raw in batch.to_pylist():
                return {str(k): jsonable(v) for k, v in raw.items()}
        return None
    head = store.read_range(obj.uri, 0, min(obj.size, SNIFF_BYTES))
    if head.startswith(UTF8_BOM):
        head = head[len(UTF8_BOM) :]
    cut = obj.size > SNIFF_BYTES
    delimiter = csv_delimiter(obj.uri) if fmt is InputFormat.CSV else None
    header: list[str] | None = None
    for record in scan_records([head], csv_delimiter=delimiter, keep_bytes=len(head)):
        if record.blank:
            continue
        if record.data is None or (cut and record.end == len(head)):
            return None  # the record goes on past what was read
        if delimiter is not None and header is None:
            header = parse_header(record.data, obj.uri, delimiter)
            continue
        fields, _, _ = _parse(
            record.data,
            size=record.end - record.start,
            header=header,
            delimiter=delimiter or ",",
            max_row_bytes=max_row_bytes,
        )
        if fields is not None:
            return fields
    return None


def iter_lines(
    store: ObjectStore, uri: str, *, max_bytes: int, chunk_bytes: int = CHUNK_BYTES
) -> Generator[tuple[int, bytes | None], None, None]:
    """(1-based line number, bytes) of every non-blank line of a JSON-lines object,
    streamed with bounded memory; the bytes are None for a line longer than
    ``max_bytes``."""

    def without_bom(chunks: Iterator[bytes]) -> Iterator[bytes]:
        first = True
        for chunk in chunks:
            if first and chunk.startswith(UTF8_BOM):
                chunk = chunk[len(UTF8_BOM) :]
            first = False
            yield chunk

    chunks = without_bom(iter_chunks(store.open_read(uri), chunk_bytes))
    for record in scan_records(chunks, keep_bytes=max_bytes):
        if not record.blank:
            yield record.line, record.data
