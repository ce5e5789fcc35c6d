"""encode: the last stage of a shard's item path, its finished ledger rows into its
output and its error file.

One writer per output kind, chosen once from the spec by :func:`writer_for`, each with
the :class:`Writer` interface:

- :class:`TableWriter`: one row per item for the job's output table (the table package
  upserts them by item id);
- :class:`EmbeddingWriter`: an embed job's items with their vectors, Parquet (a
  ``fixed_size_list<float32>`` column) or JSONL;
- :class:`OpenAIWriter`: OpenAI batch input's output lines and error-file lines, the
  lines an API batch's files are assembled from too (:meth:`OpenAIWriter.line`);
- :class:`ParquetWriter` and :class:`JsonlWriter`: every other job's rows.

A dead item's error is :func:`item_error` in every output of llm-batch's own shape;
OpenAI's shapes are :mod:`llmbatch.formats.openai_output`'s. No I/O here: the write
step reads what a writer asks for (the staged rows, the vectors) and stores what it
encodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from llmbatch import formats
from llmbatch.contract.messages import ShardSummary, TokenCounts
from llmbatch.contract.spec import InputFormat, JobSpec, OutputFormat, Task
from llmbatch.contract.states import ErrorClass, ItemStatus
from llmbatch.formats import openai_output, openai_requests
from llmbatch.formats.records import StagedRow
from llmbatch.formats.vectors import Vectors, floats
from llmbatch.ledger.items import LedgerRow


@dataclass(frozen=True)
class Encoded:
    """A shard's output: its part's bytes (a table writer's: the table's rows instead)
    and its error file's bytes (empty when no item died)."""

    part: bytes = b""
    table_rows: list[dict[str, Any]] = field(default_factory=list)
    errors: bytes = b""


class Writer(Protocol):
    """What every writer has: what it reads besides the ledger rows, where its output
    goes, and the encoding of a shard whose items are all finished."""

    # Whether the shard's staged rows go into the output (their fields, or an OpenAI
    # embeddings line's encoding_format): only then are they staged and read back.
    reads_rows: bool
    # Whether the output holds the shard's vectors (an embed job's).
    reads_vectors: bool
    # The output part's file extension; None: the output is rows of a table.
    extension: str | None

    def encode(
        self, entries: list[LedgerRow], *, rows: dict[str, StagedRow], vectors: Vectors
    ) -> Encoded:
        """The output and error file of a shard's ``entries`` (every one finished), with
        its staged ``rows`` by item id and its ``vectors`` (each empty unless read)."""
        ...


def writer_for(spec: JobSpec, input_format: InputFormat) -> Writer:
    """The writer of a job's output: a table, an embed job's vectors, OpenAI batch
    lines for OpenAI batch input, or rows as Parquet or JSONL."""
    if spec.table_output:
        return TableWriter(spec)
    if input_format is InputFormat.OPENAI:
        return OpenAIWriter(spec)
    if spec.task is Task.EMBED:
        return EmbeddingWriter(spec)
    if spec.output_format is OutputFormat.PARQUET:
        return ParquetWriter(spec)
    return JsonlWriter(spec)


def summary(shard: int, entries: list[LedgerRow]) -> ShardSummary:
    """What a shard's finished ``entries`` add up to: items, succeeded, dead, tokens."""
    succeeded = [e for e in entries if e.status is ItemStatus.SUCCEEDED]
    return ShardSummary(
        shard=shard,
        items=len(entries),
        succeeded=len(succeeded),
        dead=len(entries) - len(succeeded),
        tokens=TokenCounts(
            prompt=sum(e.prompt_tokens or 0 for e in succeeded),
            completion=sum(e.completion_tokens or 0 for e in succeeded),
        ),
    )


def item_error(entry: LedgerRow, *, attempts: bool = False) -> dict[str, Any] | None:
    """A dead item's error as llm-batch's outputs name it: its class, message and the
    input row it came from, and (``attempts``: in the error file and a table) the
    attempts it took; None for an item that succeeded."""
    if entry.status is not ItemStatus.DEAD:
        return None
    error: dict[str, Any] = {
        "class": entry.error_class,
        "message": entry.error_message,
        "source": entry.source,
    }
    if attempts:
        error["attempts"] = entry.attempt
    return error


def error_file(entries: list[LedgerRow]) -> bytes:
    """The error file of a shard's output in llm-batch's shape: a line per dead item."""
    lines = []
    for e in entries:
        error = item_error(e, attempts=True)
        if error is not None:
            lines.append({"item_id": e.item_id, "error": error})
    return formats.write_jsonl(lines)


def _fields(spec: JobSpec, row: StagedRow | None) -> dict[str, Any]:
    """The input fields an output row carries: all of the row's, or those the spec names."""
    fields = (row.fields if row is not None else None) or {}
    if spec.output_fields is not None:
        fields = {k: fields.get(k) for k in spec.output_fields}
    return fields


def output_row(spec: JobSpec, entry: LedgerRow, row: StagedRow | None) -> dict[str, Any]:
    """A generate job's output row (Parquet and JSONL)."""
    result = entry.result or {}
    return {
        "item_id": entry.item_id,
        "input": _fields(spec, row),
        "text": result.get("text"),
        "parsed": result.get("parsed"),
        "finish_reason": result.get("finish_reason"),
        "prompt_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens,
        # How the result came (generated, deduplicated, cached) and whose it is: an item
        # id of this job, or "<job>/<item>" of the earlier job a cached result came from.
        "result_source": entry.result_source,
        "shared_with": entry.shared_with,
        "error": item_error(entry),
    }


class _RowsWriter:
    """A generate job's rows, one per item, in a file format of their own."""

    reads_rows = True
    reads_vectors = False
    extension: str | None
    _write: Callable[[list[dict[str, Any]]], bytes]

    def __init__(self, spec: JobSpec) -> None:
        self._spec = spec

    def encode(
        self, entries: list[LedgerRow], *, rows: dict[str, StagedRow], vectors: Vectors
    ) -> Encoded:
        out = [output_row(self._spec, e, rows.get(e.item_id)) for e in entries]
        return Encoded(part=self._write(out), errors=error_file(entries))


class JsonlWriter(_RowsWriter):
    """A generate job's rows as JSONL."""

    extension: str | None = "jsonl"
    _write = staticmethod(formats.write_jsonl)


class ParquetWriter(_RowsWriter):
    """A generate job's rows as one Parquet file."""

    extension: str | None = "parquet"
    _write = staticmethod(formats.write_parquet)


def _own_vector(vectors: Vectors, item_id: str) -> bytes | None:
    """An embed item's one vector (the first of its staged ones); None for a dead item."""
    return vectors.get(item_id, [b""])[0] or None


class EmbeddingWriter:
    """An embed job's rows: its id, the chosen input fields, the vector (Parquet: a
    fixed-size list<float32> column; JSONL: an array of floats), its token count and,
    for a dead item, the error."""

    reads_rows = True
    reads_vectors = True

    def __init__(self, spec: JobSpec) -> None:
        self._spec = spec
        self.extension: str | None = spec.output_format.value

    def encode(
        self, entries: list[LedgerRow], *, rows: dict[str, StagedRow], vectors: Vectors
    ) -> Encoded:
        out: list[dict[str, Any]] = [
            {
                "item_id": e.item_id,
                "input": _fields(self._spec, rows.get(e.item_id)),
                "prompt_tokens": e.prompt_tokens,
                "error": item_error(e),
            }
            for e in entries
        ]
        own = [_own_vector(vectors, e.item_id) for e in entries]
        if self._spec.output_format is OutputFormat.JSONL:
            for row, vector in zip(out, own, strict=True):
                row["embedding"] = None if vector is None else floats(vector)
            return Encoded(part=formats.write_jsonl(out), errors=error_file(entries))
        # Parquet: the input fields as columns of their own, beside the vector column.
        flat = [{"item_id": r.pop("item_id"), **r.pop("input"), **r} for r in out]
        for row in flat:
            row.pop("embedding", None)  # an input field of that name gives way to the vector
        part = formats.write_parquet(flat, arrays={"embedding": (-2, vector_column(own))})
        return Encoded(part=part, errors=error_file(entries))


def vector_column(vectors: list[bytes | None]) -> pa.Array:
    """Vectors as one Arrow column: ``fixed_size_list<float32>[d]`` when all have one
    dimension (what vector stores and pandas/polars/duckdb take as is), else a list."""
    sizes = {len(v) // 4 for v in vectors if v is not None}
    valid = [v is not None for v in vectors]
    if len(sizes) <= 1:
        size = sizes.pop() if sizes else 1
        flat = b"".join(v if v is not None else bytes(4 * size) for v in vectors)
        values = pa.Array.from_buffers(pa.float32(), len(flat) // 4, [None, pa.py_buffer(flat)])
        return pa.FixedSizeListArray.from_arrays(
            values, size, mask=pa.array([not ok for ok in valid])
        )
    return pa.array(
        [None if v is None else floats(v) for v in vectors], type=pa.list_(pa.float32())
    )


class TableWriter:
    """One row per item for the job's output table (columns:
    :mod:`llmbatch.tables.sink`): a dead item's error class in a column of its own."""

    reads_rows = True
    extension: str | None = None

    def __init__(self, spec: JobSpec) -> None:
        self._spec = spec
        self.reads_vectors = spec.task is Task.EMBED

    def encode(
        self, entries: list[LedgerRow], *, rows: dict[str, StagedRow], vectors: Vectors
    ) -> Encoded:
        out = [self._row(e, rows.get(e.item_id), vectors) for e in entries]
        return Encoded(table_rows=out, errors=error_file(entries))

    def _row(self, entry: LedgerRow, staged: StagedRow | None, vectors: Vectors) -> dict[str, Any]:
        spec = self._spec
        result = entry.result or {}
        error = item_error(entry, attempts=True)
        error_class = error.pop("class") if error is not None else None
        row: dict[str, Any] = {
            "item_id": entry.item_id,
            "job_id": spec.job_id,
            "status": str(entry.status),
            "prompt_tokens": entry.prompt_tokens,
            "input": None if spec.output_fields is None else _fields(spec, staged),
            "error_class": str(error_class) if error_class else None,
            "error": error,
        }
        if self.reads_vectors:
            vector = _own_vector(vectors, entry.item_id)
            row["embedding"] = None if vector is None else floats(vector)
            return row
        row.update(
            text=result.get("text"),
            parsed=result.get("parsed"),
            finish_reason=result.get("finish_reason"),
            completion_tokens=entry.completion_tokens,
            result_source=None if entry.result_source is None else str(entry.result_source),
            shared_with=entry.shared_with,
        )
        return row


class OpenAIWriter:
    """OpenAI batch input's output: an output line per succeeded request, an error-file
    line per dead one, in OpenAI's shapes, matched by ``custom_id``."""

    extension: str | None = "jsonl"
    # An embeddings line's vectors are written in its own encoding_format, which its
    # staged row holds; a completion's line is made from the ledger alone.
    reads_vectors: bool
    reads_rows: bool

    def __init__(self, spec: JobSpec) -> None:
        self._spec = spec
        self.reads_rows = self.reads_vectors = spec.task is Task.EMBED
        self._chat = None if self.reads_vectors else openai_output.ChatLines(spec)

    def encode(
        self, entries: list[LedgerRow], *, rows: dict[str, StagedRow], vectors: Vectors
    ) -> Encoded:
        out = bytearray()
        errors: list[dict[str, Any]] = []
        chat = self._chat  # a cached shard's whole work is this loop: no lookups in it
        for e in entries:
            if chat is not None and e.status is ItemStatus.SUCCEEDED and chat.encode_into(out, e):
                continue
            encoding = "float"
            if self.reads_vectors and e.status is ItemStatus.SUCCEEDED:
                staged = rows.get(e.item_id)
                body = ((staged.fields if staged is not None else None) or {}).get("body")
                # Validated at render, so the line's format is one of the two.
                encoding = openai_requests.encoding_format(body)
            line, ok = self.line(
                e.item_id,
                e,
                vectors=vectors.get(e.item_id) if self.reads_vectors else None,
                encoding=encoding,
            )
            if ok:
                out += formats.write_jsonl([line])
            else:
                errors.append(line)
        return Encoded(part=bytes(out), errors=formats.write_jsonl(errors))

    def line(
        self,
        custom_id: str,
        row: LedgerRow | None,
        *,
        vectors: list[bytes] | None = None,
        encoding: str = "float",
        unfinished: ErrorClass = ErrorClass.BATCH_CANCELLED,
    ) -> tuple[dict[str, Any], bool]:
        """The output line (True) or error-file line (False) of the request
        ``custom_id``, from its ledger ``row``: a request without a finished row (never
        registered, or still unfinished when its batch ended) did not run, and is named
        as ``unfinished`` (its batch expired or was cancelled)."""
        spec = self._spec
        if row is not None and row.status is ItemStatus.SUCCEEDED:
            return openai_output.result_line(spec, row, vectors=vectors, encoding=encoding), True
        if row is not None and row.status is ItemStatus.DEAD:
            return openai_output.dead_line(
                job_id=spec.job_id,
                custom_id=custom_id,
                error_class=row.error_class,
                message=row.error_message,
                source=row.source,
            ), False
        return openai_output.dead_line(
            job_id=spec.job_id,
            custom_id=custom_id,
            error_class=unfinished,
            message=None,
            source=None,
        ), False


def api_file_lines(lines: list[dict[str, Any]]) -> bytes:
    """Lines of an API batch's output or error file. json's text (a space after each
    separator), not the parts' compact JSON: the files served have always been so."""
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
