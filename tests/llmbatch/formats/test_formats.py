"""Planning and reading inputs: every row exactly once, bad rows reported with their
line; format detection; the output writers."""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch import formats
from llmbatch.config import Settings
from llmbatch.contract.spec import InputFormat
from llmbatch.contract.uris import scheme_of
from llmbatch.storage.base import ObjectInfo, ObjectStore
from llmbatch.storage.local import LocalStore
from llmbatch.storage.stores import open_store

# Format tests read only their own tmp files: no root to keep them in.
STORE = LocalStore(["/"])


def write(tmp_path: Path, name: str, data: bytes) -> ObjectInfo:
    path = tmp_path / name
    path.write_bytes(data)
    return ObjectInfo(str(path), len(data))


def read_all(
    obj: ObjectInfo,
    fmt: InputFormat,
    *,
    store: ObjectStore = STORE,
    max_row_bytes: int = 200,
    shard_size: int = 1000,
    chunk_bytes: int = formats.CHUNK_BYTES,
) -> list[formats.SourceRow]:
    plans = formats.plan_shards(store, [obj], fmt, shard_size=shard_size, chunk_bytes=chunk_bytes)
    assert all(0 < p.row_count <= shard_size for p in plans)
    rows = [
        r
        for p in plans
        for r in formats.read_shard(
            store, p, fmt, max_row_bytes=max_row_bytes, chunk_bytes=chunk_bytes
        )
    ]
    assert [r.ordinal for r in rows] == list(range(len(rows)))
    return rows


def lines_of(rows: list[formats.SourceRow]) -> list[int]:
    return [int(r.source.rsplit(" ", 1)[1]) for r in rows]


def assert_ranges_cover_all_records(data: bytes, plans: list[formats.ShardPlan]) -> None:
    """Shard ranges are in order, never overlap, and leave out only blank lines (and a
    CSV header): concatenated, they are the whole file's records."""
    position = 0
    for plan in plans:
        assert plan.start >= position
        assert not data[position : plan.start].strip() or position == 0
        position = plan.end
    assert not data[position:].strip()


# --- JSONL --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("shard_size", [1, 10, 1000])
def test_jsonl_every_row_once_across_shards_and_chunks(
    tmp_path: Path, chunk_bytes: int, shard_size: int
) -> None:
    lines = [json.dumps({"i": i, "text": "x" * (i % 13) + "é"}) for i in range(103)]
    lines[50:50] = ["", "   ", "\t"]  # blank lines: no rows, but they count as lines
    data = "\n".join(lines).encode()  # no final newline; 103 rows, size not a chunk multiple
    obj = write(tmp_path, "a.jsonl", data)
    plans = formats.plan_shards(
        STORE, [obj], InputFormat.JSONL, shard_size=shard_size, chunk_bytes=chunk_bytes
    )
    assert sum(p.row_count for p in plans) == 103
    assert len(plans) == -(-103 // shard_size)
    assert_ranges_cover_all_records(data, plans)
    rows = read_all(obj, InputFormat.JSONL, shard_size=shard_size, chunk_bytes=chunk_bytes)
    assert [r.fields["i"] for r in rows if r.fields] == list(range(103))
    assert rows[41].source == f"{obj.uri}:line 42"
    assert rows[50].source == f"{obj.uri}:line 54"  # after the three blank lines
    assert rows[-1].source == f"{obj.uri}:line 106"


def test_jsonl_poison_rows_come_back_with_their_line(tmp_path: Path) -> None:
    data = b"\r\n".join(
        [
            b'{"ok": 1}',
            b"",  # blank: not a row, but a line
            b"{not json",
            b'{"bad": "\xff\xfe"}',
            b"[1, 2]",
            b'"text"',
            b'{"big": "' + b"x" * 300 + b'"}',
            b"   ",
            b'{"ok": 2}',
            b"null",
        ]
    )
    for chunk_bytes in (3, 1 << 20):
        rows = read_all(
            write(tmp_path, "p.jsonl", data), InputFormat.JSONL, shard_size=2,
            chunk_bytes=chunk_bytes,
        )  # fmt: skip
        got = [(r.source.rsplit(":", 1)[1], r.error_class) for r in rows]
        assert got == [
            ("line 1", None),
            ("line 3", "InvalidRow"),
            ("line 4", "InvalidRow"),
            ("line 5", "InvalidRow"),
            ("line 6", "InvalidRow"),
            ("line 7", "RowTooLarge"),
            ("line 9", None),
            ("line 10", "InvalidRow"),
        ]
        assert rows[0].fields == {"ok": 1} and rows[6].fields == {"ok": 2}
        assert all(r.fields is None for r in rows[1:6])
        assert "not valid JSON" in (rows[1].error or "")
        assert "UTF-8" in (rows[2].error or "")
        assert "JSON array, not an object" in (rows[3].error or "")
        assert "JSON string" in (rows[4].error or "")
        assert "over the 200-byte limit" in (rows[5].error or "")
        assert "JSON null" in (rows[7].error or "")


def test_row_size_limit_excludes_the_newline(tmp_path: Path) -> None:
    exact = b'{"a":"' + b"x" * 92 + b'"}'  # 100 bytes
    obj = write(tmp_path, "s.jsonl", exact + b"\r\n" + exact + b"x\n" + exact)
    rows = read_all(obj, InputFormat.JSONL, max_row_bytes=100)
    assert [r.error_class for r in rows] == [None, "RowTooLarge", None]


def test_a_huge_line_costs_no_memory(tmp_path: Path) -> None:
    huge = b'{"a": "' + b"x" * (20 << 20) + b'"}'
    obj = write(tmp_path, "h.jsonl", b'{"n": 1}\n' + huge + b'\n{"n": 2}\n')
    tracemalloc.start()
    try:
        rows = read_all(obj, InputFormat.JSONL, max_row_bytes=1 << 16, chunk_bytes=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.error_class for r in rows] == [None, "RowTooLarge", None]
    assert "over the 65,536-byte limit" in (rows[1].error or "")
    assert peak < 4 << 20, f"peak {peak} bytes for a 20 MiB line"


def test_jsonl_with_a_byte_order_mark(tmp_path: Path) -> None:
    obj = write(tmp_path, "b.jsonl", b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    rows = read_all(obj, InputFormat.JSONL, shard_size=1)
    assert [r.fields for r in rows] == [{"a": 1}, {"a": 2}]
    assert formats.detect_format(obj.uri, Path(obj.uri).read_bytes()) is InputFormat.JSONL


def test_empty_inputs_plan_no_shards(tmp_path: Path) -> None:
    for name, data in [
        ("e.jsonl", b""),
        ("w.jsonl", b"\n \n"),
        ("e.csv", b""),
        ("h.csv", b"a,b\n"),
    ]:
        obj = write(tmp_path, name, data)
        fmt = InputFormat.CSV if name.endswith(".csv") else InputFormat.JSONL
        assert formats.plan_shards(STORE, [obj], fmt, shard_size=10) == []


def test_ordinals_run_on_across_objects_and_stores(
    tmp_path: Path, storage_settings: Settings, bucket: str
) -> None:
    a = write(tmp_path, "a.jsonl", b'{"x":1}\n{"x":2}\n{"x":3}\n')
    s3 = open_store(f"s3://{bucket}", storage_settings)
    s3.put_bytes(f"s3://{bucket}/b.jsonl", b'{"x":4}\n{"x":5}\n')
    b = ObjectInfo(f"s3://{bucket}/b.jsonl", 16)

    def store_for(uri: str) -> ObjectStore:
        return s3 if scheme_of(uri) == "s3" else STORE

    plans = formats.plan_shards(store_for, [a, b], InputFormat.JSONL, shard_size=2)
    assert [(p.index, p.uri, p.first_row, p.row_count) for p in plans] == [
        (0, a.uri, 0, 2),
        (1, a.uri, 2, 1),  # a shard never spans two objects
        (2, b.uri, 3, 2),
    ]
    rows = [r for p in plans for r in formats.read_shard(store_for(p.uri), p, InputFormat.JSONL)]
    assert [(r.ordinal, r.fields) for r in rows] == [(i, {"x": i + 1}) for i in range(5)]
    assert rows[4].source == f"{b.uri}:line 2"


def test_a_changed_input_fails_the_read(tmp_path: Path) -> None:
    obj = write(tmp_path, "c.jsonl", b'{"a":1}\n{"a":2}\n')
    [plan] = formats.plan_shards(STORE, [obj], InputFormat.JSONL, shard_size=10)
    Path(obj.uri).write_bytes(b'{"a":1}\n{"a":2}\n{"a":3}\n')
    with pytest.raises(formats.InputChanged, match="not the 16 it was"):
        list(formats.read_shard(STORE, plan, InputFormat.JSONL))
    Path(obj.uri).write_bytes(b'{"a":1} {"a":2}\n')  # same size, one row fewer
    with pytest.raises(formats.InputChanged, match="holds 1 rows, not the 2 planned"):
        list(formats.read_shard(STORE, plan, InputFormat.JSONL))


# --- CSV ----------------------------------------------------------------------------


def test_csv_keeps_quoted_newlines_whole(tmp_path: Path) -> None:
    data = (
        b'id,text\n1,"first\nstill first"\n2,plain\n3,"a ""quoted"" one"\n'
        b'4,"multi\nline\nthree"\n5,x,extra\n\n6,last\n7,"x,y"\n8,12" pipe\n9,"unclosed\n10,z\n'
    )
    obj = write(tmp_path, "c.csv", data)
    for chunk_bytes in (1, 2, 5, 1 << 20):
        plans = formats.plan_shards(
            STORE, [obj], InputFormat.CSV, shard_size=2, chunk_bytes=chunk_bytes
        )
        assert all(p.header == ["id", "text"] for p in plans)
        assert [p.first_line for p in plans] == [2, 5, 9, 12, 14]
        rows = read_all(obj, InputFormat.CSV, shard_size=2, chunk_bytes=chunk_bytes)
        fields = [r.fields for r in rows]
        assert fields[0] == {"id": "1", "text": "first\nstill first"}
        assert fields[1] == {"id": "2", "text": "plain"}
        assert fields[2] == {"id": "3", "text": 'a "quoted" one'}
        assert fields[3] == {"id": "4", "text": "multi\nline\nthree"}
        assert rows[4].error_class == "InvalidRow" and "3 fields" in (rows[4].error or "")
        assert fields[5] == {"id": "6", "text": "last"}
        assert fields[6] == {"id": "7", "text": "x,y"}
        assert fields[7] == {"id": "8", "text": '12" pipe'}  # a plain quote, as csv reads it
        # A quote left open runs to the end of the file: one bad row, not lost rows.
        assert rows[8].error_class == "InvalidRow" and len(rows) == 9
        assert lines_of(rows) == [2, 4, 5, 6, 9, 11, 12, 13, 14]


def test_csv_bad_quoting_is_an_invalid_row(tmp_path: Path) -> None:
    obj = write(tmp_path, "q.csv", b'a,b\n1,"ab"cd\n2,ok\n')
    rows = read_all(obj, InputFormat.CSV)
    assert rows[0].error_class == "InvalidRow" and "not valid CSV" in (rows[0].error or "")
    assert rows[1].fields == {"a": "2", "b": "ok"}


def _field(rng: random.Random) -> tuple[str, str]:
    """(as written in the file, as csv reads it back)"""
    kind = rng.randrange(7)
    word = rng.choice(["alpha", "beta", "", "naïve", "漢字", "x" * 40])
    if kind == 0:
        return f'"{word},{word}"', f"{word},{word}"
    if kind == 1:
        return f'"{word}\n{word}\r\n"', f"{word}\n{word}\r\n"
    if kind == 2:
        return f'"say ""{word}"""', f'say "{word}"'
    if kind == 3:
        return f'5" {word}', f'5" {word}'  # a quote inside an unquoted field
    if kind == 4:
        return '""', ""
    return word, word


@pytest.mark.parametrize("seed", range(4))
def test_csv_rows_match_pythons_csv_reader_for_any_chunking(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    out = ["id,a,b"]
    expected: list[dict[str, str]] = []
    lines: list[int] = []
    line = 2
    for i in range(200):
        written, read = zip(*(_field(rng) for _ in range(2)), strict=True)
        record = f"{i}," + ",".join(written)
        out.append(record)
        expected.append({"id": str(i), "a": read[0], "b": read[1]})
        lines.append(line)
        line += record.count("\n") + 1
        if rng.random() < 0.1:
            out.append("")
            line += 1
    data = "\n".join(out).encode() + (b"\n" if seed % 2 else b"")
    reference = list(csv.DictReader(io.StringIO(data.decode(), newline="")))
    assert reference == expected  # the generator writes what csv reads
    obj = write(tmp_path, "r.csv", data)
    for chunk_bytes in (1, 3, 17, 4096):
        for shard_size in (1, 7, 1000):
            plans = formats.plan_shards(
                STORE, [obj], InputFormat.CSV, shard_size=shard_size, chunk_bytes=chunk_bytes
            )
            assert_ranges_cover_all_records(data, plans)
            rows = read_all(obj, InputFormat.CSV, shard_size=shard_size, chunk_bytes=chunk_bytes)
            assert [r.fields for r in rows] == expected
            assert lines_of(rows) == lines


def test_csv_header_variants(tmp_path: Path) -> None:
    bom = write(tmp_path, "bom.csv", b'\xef\xbb\xbfid,"na""me"\r\n1,x\r\n')
    assert [r.fields for r in read_all(bom, InputFormat.CSV)] == [{"id": "1", 'na"me': "x"}]
    tsv = write(tmp_path, "t.tsv", b'id\ttext\n1\t"a\tb"\n2\tc,d\n')
    rows = read_all(tsv, InputFormat.CSV)
    assert [r.fields for r in rows] == [{"id": "1", "text": "a\tb"}, {"id": "2", "text": "c,d"}]
    blank_first = write(tmp_path, "bl.csv", b"\n\nid\n7\n")
    rows = read_all(blank_first, InputFormat.CSV)
    assert [r.fields for r in rows] == [{"id": "7"}] and lines_of(rows) == [4]
    for name, data, message in [
        ("dup.csv", b"a,b,a\n1,2,3\n", r"repeats column\(s\) \['a'\]"),
        ("empty.csv", b"a,,c\n1,2,3\n", "empty column name"),
        ("bad.csv", b"a,\xff\n1,2\n", "cannot read the CSV header"),
    ]:
        with pytest.raises(formats.FormatError, match=message):
            formats.plan_shards(STORE, [write(tmp_path, name, data)], InputFormat.CSV, shard_size=5)


def test_csv_values_over_the_csv_modules_field_limit(tmp_path: Path) -> None:
    big = "y" * 300_000  # csv's default limit is 131,072 characters
    obj = write(tmp_path, "big.csv", f'id,text\n1,{big}\n2,"{big}"\n'.encode())
    rows = read_all(obj, InputFormat.CSV, max_row_bytes=1 << 20)
    assert [r.fields for r in rows] == [{"id": "1", "text": big}, {"id": "2", "text": big}]


# --- Parquet ------------------------------------------------------------------------


def parquet_bytes(table: pa.Table, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **kwargs)
    return buffer.getvalue()


def test_without_a_shard_size_shards_grow_to_the_largest_and_go_on_across_objects(
    tmp_path: Path,
) -> None:
    # The first shard is small, so the engine has work at once; each next one is four
    # times as large up to the largest, so a job pays each shard's fixed cost seldom.
    assert [formats.shard_rows(None, i) for i in range(5)] == [
        1000, 4000, 10_000, 10_000, 10_000,
    ]  # fmt: skip
    assert [formats.shard_rows(7, i) for i in range(3)] == [7, 7, 7]
    a = write(tmp_path, "a.jsonl", b"".join(b'{"i":%d}\n' % i for i in range(2500)))
    b = write(tmp_path, "b.jsonl", b"".join(b'{"i":%d}\n' % i for i in range(20_000)))
    d = write(tmp_path, "d.csv", b"i\n" + b"".join(b"%d\n" % i for i in range(20_000)))
    c = write(
        tmp_path,
        "c.parquet",
        parquet_bytes(pa.Table.from_pylist([{"i": i} for i in range(13_000)]), row_group_size=999),
    )
    jsonl = formats.plan_shards(STORE, [a], InputFormat.JSONL, shard_size=None)
    assert [p.row_count for p in jsonl] == [1000, 1500]
    # Sizes go on from the shards before: shard 2 is the first of b.jsonl.
    two = formats.plan_shards(STORE, [a, b], InputFormat.JSONL, shard_size=None)
    assert [p.row_count for p in two] == [1000, 1500, 10_000, 10_000]
    csv_plans = formats.plan_shards(STORE, [d], InputFormat.CSV, shard_size=None)
    assert [p.row_count for p in csv_plans] == [1000, 4000, 10_000, 5000]
    parquet = formats.plan_shards(STORE, [c], InputFormat.PARQUET, shard_size=None)
    assert [p.row_count for p in parquet] == [1000, 4000, 8000]
    rows = [r for p in parquet for r in formats.read_shard(STORE, p, InputFormat.PARQUET)]
    assert [r.fields for r in rows] == [{"i": i} for i in range(13_000)]


def test_an_objects_last_growing_shard_joins_the_one_before_when_they_fit_in_the_largest(
    tmp_path: Path,
) -> None:
    # A shard costs the same whatever its rows: 10,000 rows are 1,000 + 9,000, not
    # 1,000 + 4,000 + 5,000. The job's first shard stays small (the engine's first work).
    def lines(name: str, n: int) -> ObjectInfo:
        return write(tmp_path, name, b"".join(b'{"i":%d}\n' % i for i in range(n)))

    ten = lines("ten.jsonl", 10_000)
    plans = formats.plan_shards(STORE, [ten], InputFormat.JSONL, shard_size=None)
    assert [p.row_count for p in plans] == [1000, 9000]
    rows = [r for p in plans for r in formats.read_shard(STORE, p, InputFormat.JSONL)]
    assert [r.fields for r in rows] == [{"i": i} for i in range(10_000)]
    assert [r.ordinal for r in rows] == list(range(10_000))
    assert [p.row_count for p in formats.plan_shards(
        STORE, [lines("six.jsonl", 6000)], InputFormat.JSONL, shard_size=None
    )] == [1000, 5000]  # fmt: skip
    # Across objects: the second one's shards (4,000 + 3,000 rows) join, the first's
    # single row stays the job's first shard; a set shard_size never folds.
    one, seven = lines("one.jsonl", 1), lines("seven.jsonl", 7000)
    two = formats.plan_shards(STORE, [one, seven], InputFormat.JSONL, shard_size=None)
    assert [(p.index, p.first_row, p.row_count) for p in two] == [(0, 0, 1), (1, 1, 7000)]
    fixed = formats.plan_shards(STORE, [ten], InputFormat.JSONL, shard_size=4000)
    assert [p.row_count for p in fixed] == [4000, 4000, 2000]
    table = pa.Table.from_pylist([{"i": i} for i in range(10_000)])
    c = write(tmp_path, "c.parquet", parquet_bytes(table, row_group_size=999))
    parquet = formats.plan_shards(STORE, [c], InputFormat.PARQUET, shard_size=None)
    assert [(p.row_offset, p.row_count) for p in parquet] == [(0, 1000), (1000, 9000)]
    rows = [r for p in parquet for r in formats.read_shard(STORE, p, InputFormat.PARQUET)]
    assert [r.fields for r in rows] == [{"i": i} for i in range(10_000)]


def test_parquet_row_ranges_over_row_groups(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([{"i": i, "s": f"row {i}"} for i in range(57)])
    obj = write(tmp_path, "t.parquet", parquet_bytes(table, row_group_size=10))
    plans = formats.plan_shards(STORE, [obj], InputFormat.PARQUET, shard_size=13)
    assert [(p.row_offset, p.row_count, p.row_group_start, p.row_group_end) for p in plans] == [
        (0, 13, 0, 2),
        (13, 13, 1, 3),
        (26, 13, 2, 4),
        (39, 13, 3, 6),
        (52, 5, 5, 6),
    ]
    for shard_size in (1, 10, 13, 100):
        rows = read_all(obj, InputFormat.PARQUET, shard_size=shard_size)
        assert [r.fields for r in rows] == [{"i": i, "s": f"row {i}"} for i in range(57)]
        assert rows[20].source == f"{obj.uri}:row 21"


def test_parquet_values_become_json_values(tmp_path: Path) -> None:
    row = {
        "when": dt.datetime(2024, 5, 1, 12, 30),
        "day": dt.date(2024, 5, 1),
        "price": decimal.Decimal("12.50"),
        "blob": b"\xff\x00",
        "text": b"plain",
        "nan": float("nan"),
        "nested": {"tags": ["a", "b"], "n": 1},
    }
    obj = write(tmp_path, "v.parquet", parquet_bytes(pa.Table.from_pylist([row])))
    [read] = read_all(obj, InputFormat.PARQUET, max_row_bytes=1000)
    assert read.fields == {
        "when": "2024-05-01T12:30:00",
        "day": "2024-05-01",
        "price": "12.50",
        "blob": "base64:/wA=",
        "text": "plain",
        "nan": None,
        "nested": {"tags": ["a", "b"], "n": 1},
    }
    json.dumps(read.fields, allow_nan=False)  # staging can carry it


def test_parquet_oversize_rows_and_broken_files(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([{"t": "short"}, {"t": "x" * 500}, {"t": "short"}])
    obj = write(tmp_path, "o.parquet", parquet_bytes(table))
    rows = read_all(obj, InputFormat.PARQUET, max_row_bytes=100)
    assert [r.error_class for r in rows] == [None, "RowTooLarge", None]
    assert rows[1].source.endswith(":row 2")
    broken = write(tmp_path, "broken.parquet", b"PAR1 this is not parquet")
    with pytest.raises(formats.FormatError, match="not a readable Parquet file"):
        formats.plan_shards(STORE, [broken], InputFormat.PARQUET, shard_size=5)


# --- on S3 --------------------------------------------------------------------------


def test_every_format_on_s3_by_ranged_reads(storage_settings: Settings, bucket: str) -> None:
    s3 = open_store(f"s3://{bucket}", storage_settings)
    inputs = {
        "in/a.jsonl": (
            InputFormat.JSONL,
            b"".join(json.dumps({"n": i}).encode() + b"\n" for i in range(30)),
        ),
        "in/c.csv": (
            InputFormat.CSV,
            b"n,t\n" + b"".join(f'{i},"l1\nl2"\n'.encode() for i in range(30)),
        ),
        "in/p.parquet": (
            InputFormat.PARQUET,
            parquet_bytes(pa.table({"n": list(range(30))}), row_group_size=4),
        ),
    }
    for key, (fmt, data) in inputs.items():
        s3.put_bytes(f"s3://{bucket}/{key}", data)
        objects = s3.list(f"s3://{bucket}/{key}")
        plans = formats.plan_shards(s3, objects, fmt, shard_size=7, chunk_bytes=50)
        assert len(plans) == 5
        rows = [r for p in plans for r in formats.read_shard(s3, p, fmt, chunk_bytes=50)]
        assert [r.ordinal for r in rows] == list(range(30))
        assert [int((r.fields or {})["n"]) for r in rows] == list(range(30))
        assert rows[29].source.startswith(f"s3://{bucket}/{key}:")
    for key, data in [
        ("e/empty.jsonl", b""),
        ("e/bom.jsonl", b"\xef\xbb\xbf"),
        ("e/h.csv", b"a\n"),
    ]:
        s3.put_bytes(f"s3://{bucket}/{key}", data)
        fmt = InputFormat.CSV if key.endswith(".csv") else InputFormat.JSONL
        assert formats.plan_shards(s3, s3.list(f"s3://{bucket}/{key}"), fmt, shard_size=5) == []
    assert formats.field_names(s3, s3.list(f"s3://{bucket}/in/c.csv")[0], InputFormat.CSV) == {
        "n",
        "t",
    }


# --- detection and field names ------------------------------------------------------

OPENAI_LINE = (
    b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", '
    b'"body": {"messages": [{"role": "user", "content": "hi"}]}}\n'
)


@pytest.mark.parametrize(
    ("name", "head", "fmt"),
    [
        ("x.csv", b"a,b\n", InputFormat.CSV),
        ("x.TSV", None, InputFormat.CSV),
        ("x.parquet", None, InputFormat.PARQUET),
        ("x.pq", b"", InputFormat.PARQUET),
        ("noext", b"PAR1\x15\x04", InputFormat.PARQUET),
        ("x.jsonl", b'{"a": 1}\n', InputFormat.JSONL),
        ("x.ndjson", None, InputFormat.JSONL),
        ("x.json-lines", b"{broken\n", InputFormat.JSONL),
        ("s3://b/batch.jsonl", OPENAI_LINE, InputFormat.OPENAI),
        ("batch.jsonl", b"\xef\xbb\xbf\n" + OPENAI_LINE, InputFormat.OPENAI),
        ("noext", b'{"custom_id": "1", "body": {}}\n', InputFormat.JSONL),  # no url
        ("noext", b'{"a": 1}\n', InputFormat.JSONL),
    ],
)  # fmt: skip
def test_detect_format(name: str, head: bytes | None, fmt: InputFormat) -> None:
    assert formats.detect_format(name, head) is fmt


@pytest.mark.parametrize(
    ("name", "head", "message"),
    [
        ("data.bin", b"\x00\x01", "cannot tell the format"),
        ("data.json", b"[1, 2, 3]", "cannot tell the format"),
        ("data.jsonl.gz", b"\x1f\x8b", "compressed"),
        ("noext", None, "cannot tell the format"),
    ],
)
def test_unknown_formats_are_clear_errors(name: str, head: bytes | None, message: str) -> None:
    with pytest.raises(formats.FormatError, match=message):
        formats.detect_format(name, head)


def test_field_names(tmp_path: Path) -> None:
    jsonl = write(tmp_path, "f.jsonl", b'{"a": 1}\n\nnot json\n{"b": 2, "a": 3}\n')
    assert formats.field_names(STORE, jsonl, InputFormat.JSONL) == {"a", "b"}
    csv_obj = write(tmp_path, "f.csv", b'\xef\xbb\xbf\nid,"multi\nline"\n1,2\n')
    assert formats.field_names(STORE, csv_obj, InputFormat.CSV) == {"id", "multi\nline"}
    pq_obj = write(tmp_path, "f.parquet", parquet_bytes(pa.table({"x": [1], "y": ["a"]})))
    assert formats.field_names(STORE, pq_obj, InputFormat.PARQUET) == {"x", "y"}


# --- output -------------------------------------------------------------------------


def test_output_writers_round_trip() -> None:
    rows: list[dict[str, Any]] = [
        {"item_id": "a", "input": {"x": 1}, "parsed": None, "text": "t ünï", "error": None},
        {"item_id": "b", "input": {"x": 2}, "parsed": {"k": [1]}, "text": None, "error": None},
        {"item_id": "c", "input": {"x": 3}, "parsed": "plain", "text": "\n", "extra": 1.5},
    ]
    jsonl = formats.write_jsonl(rows)
    assert jsonl.count(b"\n") == 3 and "ünï".encode() in jsonl
    assert list(formats.read_jsonl_bytes(jsonl)) == rows
    back = list(formats.read_parquet_bytes(formats.write_parquet(rows)))
    assert back == [
        {"extra": None, **rows[0]},
        {"extra": None, **rows[1]},
        {"error": None, **rows[2]},
    ]
    assert list(formats.read_parquet_bytes(formats.write_parquet([]))) == []


def test_parquet_output_is_plain_columns_for_other_tools() -> None:
    data = formats.write_parquet([{"id": "a", "n": 1, "meta": {"k": "v"}}, {"id": "b", "n": 2.5}])
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.field("id").type == pa.string()
    assert table.schema.field("n").type == pa.float64()
    assert table.column("meta").to_pylist() == ['{"k":"v"}', None]  # JSON text


def test_iter_lines_streams_non_blank_lines_with_their_numbers(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n' + b"x" * 50 + b'\n{"b": 2}')
    lines = list(formats.iter_lines(STORE, str(path), max_bytes=20, chunk_bytes=7))
    assert lines == [(1, b'{"a": 1}\n'), (4, None), (5, b'{"b": 2}')]
