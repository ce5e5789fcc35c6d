"""The encode stage without any server: one writer per output kind, chosen from the
spec; every output names a dead item's error as the one error object does; OpenAI
batch lines are the same in a shard's part and in an API batch's files."""

from __future__ import annotations

import io
import json
import struct
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmbatch.contract.spec import ApiBatch, ApiEndpoint, InputFormat, JobSpec, Task
from llmbatch.contract.states import ErrorClass, ItemStatus, ResultSource
from llmbatch.formats.openai_output import BATCH_EXPIRED, result_line
from llmbatch.formats.records import StagedRow
from llmbatch.formats.writers import read_jsonl_bytes, read_parquet_bytes, write_jsonl
from llmbatch.ledger.items import LedgerRow
from llmbatch.stages.encode import (
    EmbeddingWriter,
    JsonlWriter,
    OpenAIWriter,
    ParquetWriter,
    TableWriter,
    item_error,
    summary,
    writer_for,
)

TABLE = "postgresql://db.internal:5432/app?table=out"
AT = datetime(2026, 1, 2, tzinfo=UTC)
PTR = {"vectors": "s3://b/v/0", "offset": 0, "count": 1, "dimensions": 2}


def spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {
        "job_id": "j",
        "inputs": ["s3://b/in.jsonl"],
        "model": "m",
        "output_uri": "s3://b/out",
    }
    if fields.get("task") is Task.EMBED:
        base["text"] = "{{ q }}"
    else:
        base["messages"] = [{"role": "user", "content": "{{ q }}"}]
    return JobSpec.model_validate({**base, **fields})


def succeeded(item_id: str, result: dict[str, Any] | None = None) -> LedgerRow:
    result = result or {"text": f"answer {item_id}", "finish_reason": "stop"}
    return LedgerRow(
        item_id, 0, ItemStatus.SUCCEEDED, 1, f"s3://b/in.jsonl:line {item_id}", result,
        3, 2, 1.0, None, None, AT, ResultSource.GENERATED, None,
    )  # fmt: skip


def dead(item_id: str, error_class: ErrorClass = ErrorClass.INVALID_REQUEST) -> LedgerRow:
    return LedgerRow(
        item_id, 1, ItemStatus.DEAD, 2, "s3://b/in.jsonl:line 2", None,
        None, None, None, error_class, "it cannot run", AT,
    )  # fmt: skip


def staged(item_id: str, **fields: Any) -> StagedRow:
    return StagedRow(item_id=item_id, ordinal=0, source="", fields={"q": item_id, **fields})


def vector(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize(
    ("fields", "fmt", "kind", "extension", "reads"),
    [
        ({}, InputFormat.JSONL, JsonlWriter, "jsonl", (True, False)),
        ({"output_format": "parquet"}, InputFormat.CSV, ParquetWriter, "parquet", (True, False)),
        ({"task": Task.EMBED}, InputFormat.JSONL, EmbeddingWriter, "jsonl", (True, True)),
        (
            {"task": Task.EMBED, "output_format": "parquet"},
            InputFormat.PARQUET,
            EmbeddingWriter,
            "parquet",
            (True, True),
        ),
        # An OpenAI batch file answered with completions is written from the ledger alone.
        ({}, InputFormat.OPENAI, OpenAIWriter, "jsonl", (False, False)),
        ({"output_format": "parquet"}, InputFormat.OPENAI, OpenAIWriter, "jsonl", (False, False)),
        # Embeddings lines: their vectors, in the encoding their staged line asks.
        ({"task": Task.EMBED}, InputFormat.OPENAI, OpenAIWriter, "jsonl", (True, True)),
        ({"output_uri": TABLE}, InputFormat.OPENAI, TableWriter, None, (True, False)),
        (
            {"output_uri": TABLE, "task": Task.EMBED},
            InputFormat.CSV,
            TableWriter,
            None,
            (True, True),
        ),
    ],
)
def test_one_writer_per_output_kind_is_chosen_from_the_spec(
    fields: dict[str, Any],
    fmt: InputFormat,
    kind: type,
    extension: str | None,
    reads: tuple[bool, bool],
) -> None:
    writer = writer_for(spec(**fields), fmt)
    assert type(writer) is kind
    assert writer.extension == extension
    assert (writer.reads_rows, writer.reads_vectors) == reads


def test_every_output_names_a_dead_items_error_as_the_one_error_object_does() -> None:
    entries = [succeeded("a"), dead("b")]
    error = item_error(entries[1])
    source = "s3://b/in.jsonl:line 2"
    assert error == {"class": "InvalidRequest", "message": "it cannot run", "source": source}
    assert item_error(entries[0]) is None
    rows = {e.item_id: staged(e.item_id) for e in entries}
    # The output rows of each kind carry it as it is.
    for writer, read in (
        (JsonlWriter(spec()), read_jsonl_bytes),
        (ParquetWriter(spec(output_format="parquet")), read_parquet_bytes),
        (EmbeddingWriter(spec(task=Task.EMBED)), read_jsonl_bytes),
        (EmbeddingWriter(spec(task=Task.EMBED, output_format="parquet")), read_parquet_bytes),
    ):
        encoded = writer.encode(entries, rows=rows, vectors={"a": [vector(1, 2)]})
        out = {r["item_id"]: r for r in read(encoded.part)}
        assert out["a"]["error"] is None and out["b"]["error"] == error, type(writer)
        # The error file: the same object, with the attempts the item took.
        assert list(read_jsonl_bytes(encoded.errors)) == [
            {"item_id": "b", "error": {**error, "attempts": 2}}
        ]
    # A table keeps the class in a column of its own.
    table = TableWriter(spec(output_uri=TABLE)).encode(entries, rows=rows, vectors={})
    by_id = {r["item_id"]: r for r in table.table_rows}
    assert by_id["b"]["error_class"] == "InvalidRequest"
    assert by_id["b"]["error"] == {"message": "it cannot run", "source": source, "attempts": 2}
    assert (by_id["a"]["error_class"], by_id["a"]["error"]) == (None, None)
    assert list(read_jsonl_bytes(table.errors)) == [
        {"item_id": "b", "error": {**error, "attempts": 2}}
    ]


def test_a_shard_without_dead_items_has_an_empty_error_file() -> None:
    for writer in (JsonlWriter(spec()), OpenAIWriter(spec()), TableWriter(spec(output_uri=TABLE))):
        assert writer.encode([succeeded("a")], rows={}, vectors={}).errors == b""


def test_rows_carry_the_chosen_input_fields_and_how_the_result_came() -> None:
    entry = succeeded("a")
    cached = replace(entry, result_source=ResultSource.CACHED, shared_with="j0/x")
    rows = {"a": staged("a", other=1)}
    encoded = JsonlWriter(spec(output_fields=["q", "missing"])).encode(
        [cached], rows=rows, vectors={}
    )
    (row,) = read_jsonl_bytes(encoded.part)
    assert row["input"] == {"q": "a", "missing": None}
    assert (row["result_source"], row["shared_with"]) == ("cached", "j0/x")
    assert (row["text"], row["prompt_tokens"], row["completion_tokens"]) == ("answer a", 3, 2)


def test_an_embeddings_parquet_part_has_a_fixed_size_vector_column() -> None:
    entries = [succeeded("a", PTR), succeeded("b", PTR), dead("c")]
    rows = {e.item_id: staged(e.item_id, embedding="an input field") for e in entries}
    writer = EmbeddingWriter(spec(task=Task.EMBED, output_format="parquet"))
    vectors = {"a": [vector(1, 2)], "b": [vector(3, 4)]}
    table = pq.read_table(io.BytesIO(writer.encode(entries, rows=rows, vectors=vectors).part))
    # The input fields are columns; the one named as the vector column gives way.
    assert table.column_names == ["item_id", "q", "embedding", "prompt_tokens", "error"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 2)
    assert table.column("embedding").to_pylist() == [[1.0, 2.0], [3.0, 4.0], None]
    # Vectors of different sizes: a plain list column.
    vectors["b"] = [vector(3, 4, 5)]
    mixed = pq.read_table(io.BytesIO(writer.encode(entries, rows=rows, vectors=vectors).part))
    assert mixed.schema.field("embedding").type == pa.list_(pa.float32())


def test_openai_lines_are_the_same_in_a_shard_part_and_in_an_api_batchs_files() -> None:
    """A shard's part and an API batch's file are made by one writer: each line of the
    part is what :meth:`OpenAIWriter.line` gives the API's assembly for its request."""
    api = ApiBatch(project="p", endpoint=ApiEndpoint.CHAT_COMPLETIONS, completion_window_s=60)
    writer = OpenAIWriter(spec(api_batch=api))
    n2 = {"text": "x", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}]}
    entries = [succeeded("a"), succeeded("n", n2), dead("d"), dead("e", ErrorClass.BATCH_EXPIRED)]
    encoded = writer.encode(entries, rows={}, vectors={})
    lines = [writer.line(e.item_id, e) for e in entries]
    assert encoded.part == write_jsonl([line for line, ok in lines if ok])
    assert encoded.errors == write_jsonl([line for line, ok in lines if not ok])
    # The common chat line (encoded straight to bytes) is the result line's dict.
    first = write_jsonl([result_line(spec(api_batch=api), entries[0])])
    assert encoded.part.startswith(first)
    d = json.loads(encoded.errors.splitlines()[0])
    assert d["response"]["status_code"] == 400
    assert d["error"] == {"code": "InvalidRequest", "message": "it cannot run (line 2)"}
    assert json.loads(encoded.errors.splitlines()[1])["error"]["code"] == BATCH_EXPIRED


def test_a_request_with_no_finished_row_did_not_run_and_is_named_as_its_batch_ended() -> None:
    writer = OpenAIWriter(spec())
    line, ok = writer.line("gone", None, unfinished=ErrorClass.BATCH_EXPIRED)
    assert not ok and line["custom_id"] == "gone" and line["error"]["code"] == BATCH_EXPIRED
    running = replace(succeeded("r"), status=ItemStatus.RUNNING)
    line, ok = writer.line("r", running)
    assert not ok and line["error"]["code"] == "batch_cancelled"


def test_embeddings_lines_take_the_encoding_their_staged_line_asks_for() -> None:
    writer = OpenAIWriter(spec(task=Task.EMBED))
    entries = [succeeded("f", PTR), succeeded("b", PTR)]
    body = {"input": "x"}
    rows = {
        "f": staged("f", body=body),
        "b": staged("b", body={**body, "encoding_format": "base64"}),
    }
    vectors = {"f": [vector(1, 2)], "b": [vector(1, 2)]}
    out = list(read_jsonl_bytes(writer.encode(entries, rows=rows, vectors=vectors).part))
    data = [line["response"]["body"]["data"][0]["embedding"] for line in out]
    assert data == [[1.0, 2.0], "AACAPwAAAEA="]


def test_the_summary_counts_the_items_and_the_tokens_of_those_that_succeeded() -> None:
    tally = summary(4, [succeeded("a"), succeeded("b"), dead("c")])
    assert (tally.shard, tally.items, tally.succeeded, tally.dead) == (4, 3, 2, 1)
    assert (tally.tokens.prompt, tally.tokens.completion) == (6, 4)
