"""What a job spec chooses among, as plain Python: the enums of its fields (input and
output format, task, how an endpoint is reached) and the range of its priority.

No pydantic and no Temporal here: the command line declares its options with these
(``--format``, ``--task``, ``--via``, ``--priority``) and must print its help without
loading the spec's models. :mod:`llmbatch.contract.spec` and
:mod:`llmbatch.contract.priority` import them from here.
"""

from __future__ import annotations

import enum

# Temporal's default number of priority levels (the server's matching.priorityLevels):
# 1 runs first, 5 last.
HIGHEST_PRIORITY = 1
LOWEST_PRIORITY = 5
# What a task without a priority key gets: (1 + levels) / 2.
DEFAULT_PRIORITY = (HIGHEST_PRIORITY + LOWEST_PRIORITY) // 2


class InputFormat(enum.StrEnum):
    """How input rows are encoded. ``openai`` is OpenAI batch JSONL."""

    JSONL = "jsonl"
    CSV = "csv"
    PARQUET = "parquet"
    OPENAI = "openai"
    # A Postgres table or read-only query (llmbatch.contract.tables): set from the URI.
    TABLE = "table"


class Task(enum.StrEnum):
    """What a job does with each row: generate text, or embed it as one vector.

    A GPU worker serves one task for one model, and its task queue is named for both
    (``Settings.gpu_task_queue``), so a job never lands on a worker of the other task.
    """

    GENERATE = "generate"
    EMBED = "embed"


class EndpointVia(enum.StrEnum):
    """How a job on a remote endpoint reaches it: request by request (``online``), or
    shard by shard as provider batches through its Files + Batches API (``batch``)."""

    ONLINE = "online"
    BATCH = "batch"


class OutputFormat(enum.StrEnum):
    """How a job's output parts are written: JSON lines, or Parquet columns."""

    JSONL = "jsonl"
    PARQUET = "parquet"
