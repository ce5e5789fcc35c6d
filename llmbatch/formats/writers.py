"""Output files (JSONL, Parquet).

The records staged between a shard's steps are JSONL too, but typed: see
:mod:`llmbatch.formats.records`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from llmbatch.formats.parquet import jsonable

# Parquet schema metadata naming the columns stored as JSON text.
JSON_COLUMNS_KEY = b"llmbatch.json_columns"


# Output rows hold JSON values (input fields were made so when read, results come
# from the ledger's jsonb); anything else is written as jsonable says. In C: json's
# encoder was a tenth of the CPU worker's time on a cached job.
_encoder = msgspec.json.Encoder(enc_hook=jsonable)


def _lines(data: bytes) -> Iterator[bytes]:
    # Split on "\n" only: JSON escapes every other control character inside strings.
    for line in data.split(b"\n"):
        if line.strip():
            yield line


def write_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as JSONL: UTF-8, one compact object a line, every line ending in ``\\n``."""
    buffer = bytearray()
    for row in rows:
        _encoder.encode_into(row, buffer, -1)
        buffer += b"\n"
    return bytes(buffer)


def read_jsonl_bytes(data: bytes) -> Iterator[dict[str, Any]]:
    """The objects of a JSONL file written by :func:`write_jsonl` (blank lines skipped)."""
    for line in _lines(data):
        yield json.loads(line)


def _json_column(values: list[Any]) -> bool:
    """Whether a column must be stored as JSON text: it holds nested values, or values
    of kinds Arrow cannot put in one column (numbers count as one kind)."""
    kinds = set()
    for v in values:
        if v is None:
            continue
        if isinstance(v, dict | list | tuple):
            return True
        kinds.add("number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v))
    return len(kinds) > 1


def write_parquet(
    rows: list[dict[str, Any]], *, arrays: dict[str, tuple[int, pa.Array]] | None = None
) -> bytes:
    """Rows as one Parquet file. Columns are the union of the rows' keys, in the order
    first seen (a row without a key holds null there). Columns with nested values
    (dicts, lists) or mixed kinds are stored as JSON text and named in the schema
    metadata, so :func:`read_parquet_bytes` gives back the values written; other
    tools see strings.

    ``arrays`` adds ready-made Arrow columns (name to (position, array), one value
    per row), e.g. embeddings as a fixed-size list of float32, stored as they are; a
    negative position counts from the end, as ``list.insert`` does.
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    columns: dict[str, list[Any]] = {}
    as_json = []
    for name in names:
        values = [row.get(name) for row in rows]
        if _json_column(values):
            as_json.append(name)
            values = [None if v is None else _encoder.encode(v).decode() for v in values]
        columns[name] = values
    table = pa.table(columns) if columns else pa.table({})
    for name, (position, array) in (arrays or {}).items():
        at = position if position >= 0 else max(0, table.num_columns + position)
        table = table.add_column(min(at, table.num_columns), name, array)
    table = table.replace_schema_metadata({JSON_COLUMNS_KEY: json.dumps(as_json).encode()})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def read_parquet_bytes(data: bytes) -> Iterator[dict[str, Any]]:
    """The rows of a Parquet file; the columns :func:`write_parquet` stored as JSON text
    come back as the values written."""
    table = pq.read_table(io.BytesIO(data))
    metadata = table.schema.metadata or {}
    # Files other tools wrote lack the key: nothing to decode there.
    as_json = json.loads(metadata.get(JSON_COLUMNS_KEY, b"[]"))
    for row in table.to_pylist():
        for column in as_json:
            if isinstance(row.get(column), str):
                row[column] = json.loads(row[column])
        yield row
