"""Job states, item statuses and error classes: declared once, used everywhere.

They are ``StrEnum`` members, so they travel as plain strings in JSON payloads,
SQL parameters and CLI flags (``dlq redrive --class PromptTooLong``), and compare
equal to those strings.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class JobState(enum.StrEnum):
    """Where a job is. The last five are final."""

    PLANNING = "planning"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    COMPLETED_WITH_ERRORS = "completed_with_errors"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Its deadline (an OpenAI batch's completion window) passed before it finished:
    # unfinished items stopped, finished ones are kept.
    EXPIRED = "expired"


class BatchStatus(enum.StrEnum):
    """An OpenAI Batch API batch's status, as OpenAI names it. ``validating →
    in_progress → finalizing → completed``, or ``failed``, ``expired``, or
    ``cancelling → cancelled``; each has a ``<status>_at`` timestamp."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ItemStatus(enum.StrEnum):
    """An item's status in the ledger: ``pending → running → succeeded | dead``."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DEAD = "dead"


class ResultSource(enum.StrEnum):
    """How a succeeded item got its result: the engine generated it, another item of
    the job with the same request shared its result (``deduplicated``), or a finished
    earlier job's result for the same request and model weights answered it
    (``cached``)."""

    GENERATED = "generated"
    DEDUPLICATED = "deduplicated"
    CACHED = "cached"


#: Statuses an item never leaves (but through a dead-letter re-drive).
TERMINAL_STATUSES: tuple[ItemStatus, ...] = (ItemStatus.SUCCEEDED, ItemStatus.DEAD)


class ErrorClass(enum.StrEnum):
    """Why an item is dead; users select re-drives by these names."""

    # The input row itself.
    INVALID_ROW = "InvalidRow"
    ROW_TOO_LARGE = "RowTooLarge"
    INVALID_ITEM_ID = "InvalidItemId"
    # Turning the row into a request.
    TEMPLATE_ERROR = "TemplateError"
    INVALID_REQUEST = "InvalidRequest"
    INVALID_PROMPT = "InvalidPrompt"
    # The engine's answer.
    PROMPT_TOO_LONG = "PromptTooLong"
    INVALID_STRUCTURED_OUTPUT = "InvalidStructuredOutput"
    # The shard around it failed for good (storage gone, retries spent).
    SHARD_FAILED = "ShardFailed"
    # An OpenAI Batch API batch ended before the item ran: its completion window
    # passed, or it was cancelled.
    BATCH_EXPIRED = "BatchExpired"
    BATCH_CANCELLED = "BatchCancelled"
    # No worker serving the job's model took the generate step in time.
    NO_WORKER = "NoWorker"
    # The step reached a worker that has another model loaded (it refused to run it).
    WRONG_MODEL = "WrongModel"


class FailureType(enum.StrEnum):
    """``ApplicationError`` types that llm-batch raises and matches on (retry
    policies name them as non-retryable)."""

    INVALID_JOB_SPEC = "InvalidJobSpec"
    SUPERSEDED = "Superseded"
    INCOMPLETE_SHARD = "IncompleteShard"
    JOB_NOT_RUNNING = "JobNotRunning"
    JOB_STILL_RUNNING = "JobStillRunning"
    REDRIVE_RUNNING = "RedriveRunning"
    INVALID_REDRIVE = "InvalidRedrive"
    WRONG_MODEL = "WrongModel"


class Explanation(NamedTuple):
    """What an error class or failure type means to a user, and what to do about it.

    Declared once here, beside the enums; ``llm-batch docs generate`` renders the error
    reference from these tables, and a test keeps every member covered.
    """

    cause: str
    remedy: str


ERROR_CLASS_HELP: dict[ErrorClass, Explanation] = {
    ErrorClass.INVALID_ROW: Explanation(
        "The input row cannot be read: invalid JSON or UTF-8, a CSV line that does not "
        "parse, or a row that is not an object.",
        "Fix the row in the input (the dead item names its file and line), then re-drive: "
        "`llm-batch dlq redrive JOB --class InvalidRow`.",
    ),
    ErrorClass.ROW_TOO_LARGE: Explanation(
        "The row is larger than the job's row size limit.",
        "Shorten the row, or submit the job again with a larger `max_row_bytes` (JobSpec; 1 MiB "
        "by default).",
    ),
    ErrorClass.INVALID_ITEM_ID: Explanation(
        "The row's id field (`--id-field`, `custom_id` for OpenAI input) is missing, empty, "
        "or repeats an earlier row's id; only the first row with an id runs.",
        "Give every row a unique id in the input; the copy is kept dead so nothing is "
        "dropped silently.",
    ),
    ErrorClass.TEMPLATE_ERROR: Explanation(
        "The prompt template failed on this row: a missing field, an exception, or a render "
        "past the time, size or memory limits (`LLMBATCH_RENDER_*`).",
        "Fix the template or the row; the message names the template line. Raise the "
        "limits on the CPU workers only for a template that needs more.",
    ),
    ErrorClass.INVALID_REQUEST: Explanation(
        "An OpenAI batch line asks for something llm-batch does not run: another model, a "
        "body parameter it does not support, token-id input, or embed options the model "
        "refuses.",
        "Fix the line (the message names the parameter) and submit it again; lines are never "
        "run with a parameter dropped.",
    ),
    ErrorClass.INVALID_PROMPT: Explanation(
        "The rendered prompt or text is empty, or the model's chat template cannot render "
        "the messages.",
        "Check the template and the row's fields; use a model with a chat template for "
        "chat messages.",
    ),
    ErrorClass.PROMPT_TOO_LONG: Explanation(
        "The prompt (or text to embed) is longer than the context the GPU workers were "
        "started with (`--max-model-len`).",
        "Re-drive with a cut: `llm-batch dlq redrive JOB --class PromptTooLong --set "
        "truncate_prompt_tokens=N`, or run workers with a longer context.",
    ),
    ErrorClass.INVALID_STRUCTURED_OUTPUT: Explanation(
        "The output breaks its constraint: not valid JSON, not matching `json_schema`, not "
        "one of `choice`, often because it was cut off at `max_tokens`.",
        "Re-drive with more room: `llm-batch dlq redrive JOB --class InvalidStructuredOutput "
        "--set max_tokens=N`.",
    ),
    ErrorClass.SHARD_FAILED: Explanation(
        "The shard around the item failed for good (storage down past its retries, an input "
        "object deleted mid-job); the message names the step and the cause.",
        "Fix the cause, then `llm-batch dlq redrive JOB --class ShardFailed`.",
    ),
    ErrorClass.BATCH_EXPIRED: Explanation(
        "An OpenAI Batch API batch's completion window passed before the item ran.",
        "Submit the unfinished requests again (the error file lists them), with a longer "
        "`completion_window` or more workers.",
    ),
    ErrorClass.BATCH_CANCELLED: Explanation(
        "An OpenAI Batch API batch was cancelled before the item ran.",
        "Submit the unfinished requests again if they are still wanted.",
    ),
    ErrorClass.NO_WORKER: Explanation(
        "No worker serving the job's model (and task) took the generate step within "
        "`LLMBATCH_GENERATE_SCHEDULE_TO_START`.",
        "Start a GPU worker for that model (`llm-batch worker gpu --model M`), then "
        "`llm-batch dlq redrive JOB --class NoWorker`.",
    ),
    ErrorClass.WRONG_MODEL: Explanation(
        "The step reached a worker that has another model (or task) loaded, and it refused "
        "to run it.",
        "Check that each GPU queue has only workers for its model (the queue name carries "
        "the model), then re-drive with `--class WrongModel`.",
    ),
}

FAILURE_TYPE_HELP: dict[FailureType, Explanation] = {
    FailureType.INVALID_JOB_SPEC: Explanation(
        "The job was refused before any work: missing or empty inputs, an unreadable "
        "format, a template field the input does not have, a bad JSON schema, a path outside "
        "`LLMBATCH_LOCAL_ROOTS`, or a `job_id` that differs from the workflow id.",
        "Read the one-line message, fix the spec and submit again.",
    ),
    FailureType.SUPERSEDED: Explanation(
        "A generate attempt lost its items to a newer attempt (its worker was paused past "
        "the heartbeat timeout); its writes were fenced out.",
        "Nothing: the newer attempt's results are kept. Frequent ones mean workers stall "
        "longer than the heartbeat timeout.",
    ),
    FailureType.INCOMPLETE_SHARD: Explanation(
        "`write_shard` found items of its shard that are neither succeeded nor dead.",
        "A bug or a ledger edited by hand: report it; a re-drive of the job's dead items "
        "rewrites the shard.",
    ),
    FailureType.JOB_NOT_RUNNING: Explanation(
        "Pause or resume was asked of a job that has finished or been cancelled.",
        "Nothing to do; `llm-batch status JOB` shows its final state.",
    ),
    FailureType.JOB_STILL_RUNNING: Explanation(
        "A re-drive was asked while the job still runs.",
        "Wait for the job to end (`llm-batch watch JOB`), then re-drive.",
    ),
    FailureType.REDRIVE_RUNNING: Explanation(
        "Another re-drive of the job's dead items is still running.",
        "Wait for it to finish (`llm-batch dlq list JOB`), then re-drive again.",
    ),
    FailureType.INVALID_REDRIVE: Explanation(
        "The re-drive's `--set` options are not valid for the job (a sampling option on an "
        "embed job, a value out of range).",
        "Fix the `--set` options; the message names the field.",
    ),
    FailureType.WRONG_MODEL: Explanation(
        "A worker received a shard for a model or task it does not serve and refused it; "
        "the shard's items die as `WrongModel`.",
        "Keep one model per GPU queue (workers name their queue after the model), then re-drive.",
    ),
}
