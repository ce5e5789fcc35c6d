"""Telling an input's format from its name and first bytes."""

from __future__ import annotations

import json

from llmbatch.contract.spec import JSONL_EXTENSIONS, InputFormat
from llmbatch.errors import LlmBatchError

# How much of an object to read to tell its format or list its fields.
SNIFF_BYTES = 256 << 10
PARQUET_MAGIC = b"PAR1"
UTF8_BOM = b"\xef\xbb\xbf"

CSV_EXTENSIONS = (".csv", ".tsv")
PARQUET_EXTENSIONS = (".parquet", ".pq")
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".snappy", ".zip")
# The keys that make a JSONL line an OpenAI batch request.
OPENAI_KEYS = frozenset({"custom_id", "url", "body"})


class FormatError(LlmBatchError, ValueError):
    """An input whose format cannot be told or read; retrying will not help."""


def _name(uri: str) -> str:
    return uri.rsplit("/", 1)[-1].lower()


def csv_delimiter(uri: str) -> str:
    """The field delimiter of a CSV input: a tab for ``.tsv``, else a comma."""
    return "\t" if _name(uri).endswith(".tsv") else ","


def first_json_object(head: bytes) -> dict[str, object] | None:
    """The first non-blank line of ``head`` as a JSON object, if it is one."""
    if head.startswith(UTF8_BOM):
        head = head[len(UTF8_BOM) :]
    for line in head.split(b"\n"):
        if line.strip():
            try:
                value = json.loads(line)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def detect_format(uri: str, first_bytes: bytes | None = None) -> InputFormat:
    """The format of ``uri``: by extension, by Parquet's magic bytes, and for JSON
    lines by the first line, which makes it OpenAI batch JSONL when it holds
    ``custom_id``, ``url`` and ``body``. Raises :class:`FormatError` when unsure."""
    name = _name(uri)
    if name.endswith(_COMPRESSED):
        raise FormatError(
            f"{uri} is compressed; llm-batch splits inputs by byte ranges, so give it "
            "uncompressed JSONL or CSV, or Parquet (which compresses inside)"
        )
    head = first_bytes or b""
    if name.endswith(PARQUET_EXTENSIONS) or head.startswith(PARQUET_MAGIC):
        return InputFormat.PARQUET
    if name.endswith(CSV_EXTENSIONS):
        return InputFormat.CSV
    first = first_json_object(head)
    if first is not None:
        return InputFormat.OPENAI if OPENAI_KEYS <= first.keys() else InputFormat.JSONL
    if name.endswith(JSONL_EXTENSIONS):
        return InputFormat.JSONL
    raise FormatError(
        f"cannot tell the format of {uri}: name it .jsonl, .csv, .tsv or .parquet, "
        "or set input_format"
    )
