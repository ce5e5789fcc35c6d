"""Planning and reading inputs: every row exactly once, bad rows reported with their line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch import formats
from llmbatch.contracts import InputFormat
from llmbatch.storage import LocalStore, ObjectInfo

STORE = LocalStore()


def write(tmp_path: Path, name: str, data: bytes) -> ObjectInfo:
    path = tmp_path / name
    path.write_bytes(data)
    return ObjectInfo(str(path), len(data))


def read_all(obj: ObjectInfo, fmt: InputFormat, **plan_kw: int) -> list[formats.SourceRow]:
    plans = formats.plan_shards(lambda _: STORE, [obj], fmt, **plan_kw)
    rows = [r for p in plans for r in formats.read_shard(STORE, p, fmt, max_row_bytes=200)]
    assert sum(p.row_count for p in plans) == len(rows)
    return rows


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_jsonl_every_row_once_across_shards_and_chunks(tmp_path: Path, chunk_bytes: int) -> None:
    lines = [json.dumps({"i": i, "text": "x" * (i % 13)}) for i in range(103)]
    obj = write(tmp_path, "a.jsonl", ("\n".join(lines)).encode())  # no final newline
    rows = read_all(obj, InputFormat.JSONL, shard_size=10, chunk_bytes=chunk_bytes)
    assert [r.fields["i"] for r in rows if r.fields] == list(range(103))
    assert [r.ordinal for r in rows] == list(range(103))
    assert rows[41].source == f"{obj.uri}:line 42"


def test_poison_rows_come_back_with_their_line(tmp_path: Path) -> None:
    data = b"\n".join(
        [
            b'{"ok": 1}',
            b"",  # blank: not a row, but it counts as a line
            b"{not json",
            b'{"bad": "\xff\xfe"}',
            b"[1, 2]",
            b'{"big": "' + b"x" * 300 + b'"}',
            b'{"ok": 2}',
        ]
    )
    rows = read_all(write(tmp_path, "p.jsonl", data), InputFormat.JSONL, shard_size=2)
    got = [(r.source.rsplit(":", 1)[1], r.error_class) for r in rows]
    assert got == [
        ("line 1", None),
        ("line 3", "InvalidRow"),
        ("line 4", "InvalidRow"),
        ("line 5", "InvalidRow"),
        ("line 6", "RowTooLarge"),
        ("line 7", None),
    ]
    assert "UTF-8" in (rows[2].error or "")


def test_csv_keeps_quoted_newlines_whole(tmp_path: Path) -> None:
    data = (
        b'id,text\n1,"first\nstill first"\n2,plain\n3,"a ""quoted"" one"\n'
        b'4,"multi\nline\nthree"\n5,x,extra\n6,last\n'
    )
    rows = read_all(write(tmp_path, "c.csv", data), InputFormat.CSV, shard_size=2, chunk_bytes=5)
    fields = [r.fields for r in rows]
    assert fields[0] == {"id": "1", "text": "first\nstill first"}
    assert fields[2] == {"id": "3", "text": 'a "quoted" one'}
    assert fields[3] == {"id": "4", "text": "multi\nline\nthree"}
    assert rows[4].fields is None and "3 fields" in (rows[4].error or "")
    assert fields[5] == {"id": "6", "text": "last"}
    assert [r.source.rsplit(":", 1)[1] for r in rows] == [
        "line 2", "line 4", "line 5", "line 6", "line 9", "line 10",
    ]  # fmt: skip


def test_parquet_row_ranges_over_row_groups(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"i": i} for i in range(57)]), buffer, row_group_size=10)
    obj = write(tmp_path, "t.parquet", buffer.getvalue())
    rows = read_all(obj, InputFormat.PARQUET, shard_size=13)
    assert [r.fields["i"] for r in rows if r.fields] == list(range(57))
    assert rows[20].source.endswith(":row 21")


def test_ordinals_run_on_across_objects(tmp_path: Path) -> None:
    a = write(tmp_path, "a.jsonl", b'{"x":1}\n{"x":2}\n')
    b = write(tmp_path, "b.jsonl", b'{"x":3}\n')
    plans = formats.plan_shards(lambda _: STORE, [a, b], InputFormat.JSONL, shard_size=5)
    assert [(p.index, p.first_row, p.row_count) for p in plans] == [(0, 0, 2), (1, 2, 1)]


@pytest.mark.parametrize(
    ("name", "head", "fmt"),
    [
        ("x.csv", b"a,b\n", InputFormat.CSV),
        ("x.parquet", b"PAR1", InputFormat.PARQUET),
        ("x.jsonl", b'{"a": 1}\n', InputFormat.JSONL),
        ("x.jsonl", b'{"custom_id": "1", "method": "POST", "url": "/v1/x", "body": {}}\n',
         InputFormat.OPENAI),
        ("noext", b'{"a": 1}\n', InputFormat.JSONL),
    ],
)  # fmt: skip
def test_detect_format(name: str, head: bytes, fmt: InputFormat) -> None:
    assert formats.detect_format(name, head) is fmt


def test_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(formats.FormatError, match="cannot tell the format"):
        formats.detect_format("data.bin", b"\x00\x01")


def test_output_writers_round_trip() -> None:
    rows = [
        {"item_id": "a", "input": {"x": 1}, "parsed": None, "text": "t", "error": None},
        {"item_id": "b", "input": {"x": 2}, "parsed": {"k": [1]}, "text": None, "error": None},
    ]
    assert list(formats.read_jsonl_bytes(formats.write_jsonl(rows))) == rows
    assert list(formats.read_parquet_bytes(formats.write_parquet(rows))) == rows
