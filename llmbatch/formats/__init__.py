"""Input formats: telling them apart, splitting inputs into shards, reading shards, and
writing output files.

- :mod:`~llmbatch.formats.detection`: :func:`detect_format` (JSONL, CSV, Parquet,
  OpenAI batch JSONL).
- :mod:`~llmbatch.formats.shards`: :func:`plan_shards`, :func:`shard_rows` and
  :class:`ShardPlan`; streams JSONL and CSV once (bounded memory), Parquet from its
  footer.
- :mod:`~llmbatch.formats.readers`: :func:`read_shard` yields :class:`SourceRow`; bad
  rows come back with an error and their line, never raise.
- :mod:`~llmbatch.formats.writers`: output JSONL/Parquet (staged records between a
  shard's steps are :mod:`llmbatch.formats.records`).
- OpenAI batch JSONL, one concern a module: :mod:`~llmbatch.formats.openai_requests`
  (request lines into requests), :mod:`~llmbatch.formats.openai_output` (output and
  error-file lines) and :mod:`~llmbatch.formats.openai_validation` (a whole batch file
  checked before it runs).
- :mod:`~llmbatch.formats.records`: the staged rows and requests a shard's steps hand
  each other (JSONL); :mod:`~llmbatch.formats.vectors`: an embed job's staged vectors.
- :mod:`~llmbatch.formats.planning`: planning a job: inputs into shards, templates
  checked on the first rows.

May import: ``llmbatch.contract``, ``llmbatch.storage`` and
``llmbatch.rendering`` (planning renders); the ledger only for types
(``TYPE_CHECKING``); never the engine, dedup or activities.
"""

from llmbatch.contract.spec import InputFormat
from llmbatch.formats.detection import FormatError, csv_delimiter, detect_format
from llmbatch.formats.readers import (
    MAX_ROW_BYTES,
    InputChanged,
    SourceRow,
    field_names,
    has_rows,
    iter_lines,
    read_shard,
    sample_objects,
    sample_row,
)
from llmbatch.formats.shards import CHUNK_BYTES, ShardPlan, plan_shards, shard_rows
from llmbatch.formats.writers import (
    read_jsonl_bytes,
    read_parquet_bytes,
    write_jsonl,
    write_parquet,
)

__all__ = [
    "CHUNK_BYTES",
    "MAX_ROW_BYTES",
    "FormatError",
    "InputChanged",
    "InputFormat",
    "ShardPlan",
    "SourceRow",
    "csv_delimiter",
    "detect_format",
    "field_names",
    "has_rows",
    "iter_lines",
    "plan_shards",
    "read_jsonl_bytes",
    "read_parquet_bytes",
    "read_shard",
    "sample_objects",
    "sample_row",
    "shard_rows",
    "write_jsonl",
    "write_parquet",
]
