"""Splitting inputs into shards (of a job's ``shard_size`` rows, or growing ones when it
sets none, :func:`shard_rows`), without loading them.

JSONL and CSV are streamed once, in chunks, and cut at record boundaries into byte
ranges; a CSV's header is read once and written into every one of its shards.
Parquet shards are row ranges found from the footer alone. A shard never spans two
objects, and ``first_row`` numbers rows across all inputs, so every row has one
stable position whatever the sharding.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable

from pydantic import BaseModel, Field

from llmbatch.contract.spec import (
    AUTO_FIRST_SHARD_ROWS,
    AUTO_LARGEST_SHARD_ROWS,
    AUTO_SHARD_GROWTH,
    InputFormat,
)
from llmbatch.formats.detection import UTF8_BOM, FormatError, csv_delimiter
from llmbatch.formats.parquet import open_parquet, row_group_starts
from llmbatch.formats.scanning import iter_chunks, scan_records
from llmbatch.storage.base import ObjectInfo, ObjectStore

CHUNK_BYTES = 4 << 20
# A CSV header longer than this is not a header but a broken file.
MAX_HEADER_BYTES = 1 << 20

StoreFor = Callable[[str], ObjectStore]


class ShardPlan(BaseModel):
    """One shard: a record-aligned byte range (JSONL, CSV), a row range (Parquet) or a
    key range (a table)."""

    index: int = Field(description="Position of the shard in the job, from 0.")
    uri: str = Field(description="The one object the shard reads.")
    first_row: int = Field(description="Global ordinal of the shard's first row, all inputs.")
    row_count: int = Field(description="Rows in the shard (blank lines are no rows).")
    object_size: int | None = Field(
        default=None, description="The object's size when planned; a change fails the read."
    )
    # JSONL and CSV
    start: int = Field(default=0, description="Byte range [start, end) of whole records.")
    end: int = 0
    first_line: int = Field(default=1, description="1-based line number at ``start``.")
    header: list[str] | None = Field(default=None, description="CSV column names.")
    delimiter: str = Field(default=",", description="CSV field delimiter.")
    # Parquet
    row_offset: int = Field(default=0, description="Parquet: file row of the first row.")
    row_group_start: int = Field(default=0, description="Parquet: row groups [start, end).")
    row_group_end: int = 0
    # A table or query (llmbatch.tables.source): the rows with key_after < key <= key_upto.
    key_after: str | None = Field(default=None, description="Table: keys above this (text).")
    key_upto: str | None = Field(default=None, description="Table: keys up to this (text).")
    key_type: str | None = Field(default=None, description="Table: the key's SQL type.")
    id_field: str | None = Field(default=None, description="Table: the key column.")


def shard_rows(shard_size: int | None, index: int) -> int:
    """The rows of shard ``index`` (from 0) of a job whose spec asks ``shard_size``:
    that many, or when unset :data:`AUTO_FIRST_SHARD_ROWS` growing by
    :data:`AUTO_SHARD_GROWTH` to :data:`AUTO_LARGEST_SHARD_ROWS`."""
    if shard_size is not None:
        return shard_size
    # The power is bounded: shard 100,000's would be an integer of 200,000 bits.
    return min(AUTO_FIRST_SHARD_ROWS * AUTO_SHARD_GROWTH ** min(index, 16), AUTO_LARGEST_SHARD_ROWS)


def fold_remainder(
    plans: list[ShardPlan], *, shard_size: int | None, first_index: int
) -> list[ShardPlan]:
    """One object's ``plans`` (of job shards ``first_index`` on), with growing shards
    (no ``shard_size``) the last one joined to the one before when together they have
    no more than :data:`AUTO_LARGEST_SHARD_ROWS` rows and that one is not the job's
    first, which stays small so that the engine gets work at once.

    A shard costs the same whatever its rows: a child workflow and its steps in
    Temporal, its workflow tasks, a few ledger statements and object-store calls. So
    10,000 rows are two shards, 1,000 and 9,000 rows, not three of 1,000, 4,000 and
    5,000.
    """
    if shard_size is not None or len(plans) < 2 or first_index + len(plans) == 2:
        return plans
    before, last = plans[-2], plans[-1]
    if before.row_count + last.row_count > AUTO_LARGEST_SHARD_ROWS:
        return plans
    # The ranges are adjacent in one object: the joined one starts where ``before`` does
    # and ends where ``last`` does, whichever kind of range it is.
    joined = before.model_copy(
        update={
            "row_count": before.row_count + last.row_count,
            "end": last.end,
            "row_group_end": last.row_group_end,
            "key_upto": last.key_upto,
        }
    )
    return [*plans[:-2], joined]


def plan_shards(
    store: ObjectStore | StoreFor,
    objects: list[ObjectInfo],
    fmt: InputFormat,
    *,
    shard_size: int | None,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[ShardPlan]:
    """Shards of :func:`shard_rows` rows over ``objects``, in order: the last of an
    object may have fewer, or with growing shards more (:func:`fold_remainder`).

    ``store`` is the store of every object, or a function giving each object's store
    (inputs may mix schemes). Raises :class:`FormatError` for a file that cannot be
    planned (a Parquet file that is not one, a broken CSV header).
    """
    if shard_size is not None and shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    store_for = store if callable(store) else _always(store)
    plans: list[ShardPlan] = []
    first_row = 0
    for obj in objects:
        object_store = store_for(obj.uri)
        # Sizes go on from the shards of the objects before.
        offset = len(plans)

        def rows_of(index: int, offset: int = offset) -> int:
            return shard_rows(shard_size, offset + index)

        if fmt is InputFormat.PARQUET:
            new = _plan_parquet(object_store, obj, rows_of=rows_of)
        else:
            delimiter = csv_delimiter(obj.uri) if fmt is InputFormat.CSV else None
            new = _plan_records(
                object_store, obj, delimiter=delimiter, rows_of=rows_of,
                chunk_bytes=chunk_bytes,
            )  # fmt: skip
        for plan in fold_remainder(new, shard_size=shard_size, first_index=offset):
            plan.index = len(plans)
            plan.first_row = first_row
            first_row += plan.row_count
            plans.append(plan)
    return plans


def _always(store: ObjectStore) -> StoreFor:
    return lambda _uri: store


def _plan_records(
    store: ObjectStore,
    obj: ObjectInfo,
    *,
    delimiter: str | None,
    rows_of: Callable[[int], int],
    chunk_bytes: int,
) -> list[ShardPlan]:
    # Skip a byte order mark here, so no reader ever sees it.
    skip = len(UTF8_BOM) if store.read_range(obj.uri, 0, len(UTF8_BOM)) == UTF8_BOM else 0
    chunks = iter_chunks(store.open_read(obj.uri, start=skip), chunk_bytes)
    header: list[str] | None = None
    plans: list[ShardPlan] = []
    rows = start = end = line = 0
    for record in scan_records(chunks, csv_delimiter=delimiter, offset=skip):
        if record.blank:
            continue  # blank lines are no rows
        if delimiter is not None and header is None:
            header = _read_header(store, obj.uri, record.start, record.end, delimiter)
            continue
        if rows == 0:
            start, line = record.start, record.line
        rows += 1
        end = record.end
        if rows == rows_of(len(plans)):
            plans.append(_plan(obj, start, end, line, rows, header, delimiter))
            rows = 0
    if rows:
        plans.append(_plan(obj, start, end, line, rows, header, delimiter))
    return plans


def _plan(
    obj: ObjectInfo,
    start: int,
    end: int,
    line: int,
    rows: int,
    header: list[str] | None,
    delimiter: str | None,
) -> ShardPlan:
    return ShardPlan(
        index=0, uri=obj.uri, first_row=0, row_count=rows, object_size=obj.size,
        start=start, end=end, first_line=line, header=header, delimiter=delimiter or ",",
    )  # fmt: skip


def _read_header(store: ObjectStore, uri: str, start: int, end: int, delimiter: str) -> list[str]:
    if end - start > MAX_HEADER_BYTES:
        raise FormatError(
            f"{uri}: the CSV header is over {MAX_HEADER_BYTES} bytes (an unclosed quote?)"
        )
    return parse_header(store.read_range(uri, start, end), uri, delimiter)


def parse_header(data: bytes, uri: str, delimiter: str) -> list[str]:
    """The column names in a CSV header record; unusable names are a FormatError."""
    try:
        text = data.decode("utf-8-sig")
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise FormatError(f"{uri}: cannot read the CSV header: {exc}") from exc
    if len(rows) != 1:
        raise FormatError(f"{uri}: cannot read the CSV header")
    header = rows[0]
    if not all(h.strip() for h in header):
        raise FormatError(f"{uri}: the CSV header has an empty column name: {header}")
    repeated = sorted({h for h in header if header.count(h) > 1})
    if repeated:
        raise FormatError(f"{uri}: the CSV header repeats column(s) {repeated}")
    return header


def _plan_parquet(
    store: ObjectStore, obj: ObjectInfo, *, rows_of: Callable[[int], int]
) -> list[ShardPlan]:
    metadata = open_parquet(store, obj.uri, obj.size).metadata
    starts = row_group_starts(metadata)
    total = starts[-1]
    plans: list[ShardPlan] = []
    group = 0
    offset = 0
    while offset < total:
        count = min(rows_of(len(plans)), total - offset)
        while starts[group + 1] <= offset:
            group += 1
        last = group
        while starts[last + 1] < offset + count:
            last += 1
        plans.append(
            ShardPlan(
                index=0,
                uri=obj.uri,
                first_row=0,
                row_count=count,
                object_size=obj.size,
                row_offset=offset,
                row_group_start=group,
                row_group_end=last + 1,
            )
        )
        offset += count
    return plans
