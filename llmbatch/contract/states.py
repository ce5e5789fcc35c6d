"""Job states, item statuses and error classes: declared once, used everywhere.

They are ``StrEnum`` members, so they travel as plain strings in JSON payloads,
SQL parameters and CLI flags (``dlq redrive --class PromptTooLong``), and compare
equal to those strings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class JobState(enum.StrEnum):
    """Where a job is. Those of :data:`FINAL_JOB_STATES` are final."""

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


#: A job in one of these states runs no more (but for a dead-letter re-drive of its
#: dead items); its ledger rows may be purged (``llm-batch purge``).
FINAL_JOB_STATES: tuple[JobState, ...] = (
    JobState.SUCCEEDED,
    JobState.COMPLETED_WITH_ERRORS,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.EXPIRED,
)


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
    """An item's status in the ledger: ``pending → running → succeeded | dead``; every
    legal change is in :data:`ITEM_TRANSITIONS` below."""

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

#: The item state machine: every legal change of an item's status, and the ledger
#: function (in ``llmbatch.ledger``) that makes it. Nothing else writes ``items.status``;
#: a new item starts ``pending`` (``items.register_items``). The property test
#: tests/llmbatch/ledger/test_item_states.py drives the functions at random and checks
#: every change it sees is in this table.
ITEM_TRANSITIONS: Mapping[tuple[ItemStatus, ItemStatus], str] = MappingProxyType(
    {
        (ItemStatus.PENDING, ItemStatus.RUNNING): "items.claim_items",
        # A lease that lapsed (its attempt died) is taken over by a newer attempt.
        (ItemStatus.RUNNING, ItemStatus.RUNNING): "items.claim_items",
        (ItemStatus.RUNNING, ItemStatus.SUCCEEDED): "items.record_results",
        # Answered at render, from the job's own lead or the result cache (a new item
        # is inserted succeeded).
        (ItemStatus.PENDING, ItemStatus.SUCCEEDED): "items.register_items",
        (ItemStatus.RUNNING, ItemStatus.DEAD): "items.record_dead, dead_letters.dead_letter_shard",
        # Rows that failed before anything claimed them, or a shard that failed for good.
        (ItemStatus.PENDING, ItemStatus.DEAD): "items.record_dead, dead_letters.dead_letter_shard",
        # A cancelled attempt gives back what it still holds.
        (ItemStatus.RUNNING, ItemStatus.PENDING): "items.release_items",
        # The one way out of a terminal status: the dead-letter re-drive.
        (ItemStatus.DEAD, ItemStatus.PENDING): "dead_letters.requeue_dead",
    }
)


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
    # A database table in or out failed in a way no retry cures (llmbatch.tables).
    TABLE_ERROR = "TableError"
    # An API project already has its limit of unfinished batches.
    TOO_MANY_BATCHES = "TooManyBatches"
    # An API batch's workflow started without its record (no create_api_batch update).
    BATCH_NOT_RECORDED = "BatchNotRecorded"
    # A worker stopped (SIGTERM) and gave the rest of its shard back: retried elsewhere.
    WORKER_DRAINED = "WorkerDrained"
    # A remote endpoint refused the job's requests (a wrong API key, a model it does
    # not serve): the job is paused, its items pending, the attempt retried.
    ENDPOINT_REFUSED = "EndpointRefused"


class EndpointFault(enum.StrEnum):
    """What went wrong with a request to a remote endpoint, when it is the endpoint's
    doing and not the item's: ``status`` and ``endpoint show`` name the last one, and
    those that go on pause the job (:mod:`llmbatch.remote.faults`)."""

    # Nothing answered at the base URL: connection refused, host not found, TLS failed.
    UNREACHABLE = "Unreachable"
    # No answer within the endpoint's timeout.
    TIMEOUT = "Timeout"
    # The connection closed before the answer was complete.
    CONNECTION_DROPPED = "ConnectionDropped"
    # 5xx (but 503), 408, 409, 425.
    SERVER_ERROR = "ServerError"
    # A 2xx whose body is not JSON, or not an answer to the request (an HTML page).
    UNUSABLE_ANSWER = "UnusableAnswer"
    # 429 or 503: the endpoint asked us to wait.
    THROTTLED = "Throttled"
    # 401/403 or a model it does not serve.
    REFUSED = "Refused"
