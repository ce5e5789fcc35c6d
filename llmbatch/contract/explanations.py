"""What each error class and failure type means to a user, and what to do about it.

Declared once, beside the enums of :mod:`llmbatch.contract.states` (kept in a module of
their own so the enums stay short); ``llm-batch docs generate`` renders the error
reference from these tables, and a test keeps every member covered. Pure data, safe to
import anywhere.
"""

from __future__ import annotations

from typing import NamedTuple

from llmbatch.contract.states import EndpointFault, ErrorClass, FailureType


class Explanation(NamedTuple):
    """What an error class or failure type means to a user, and what to do about it."""

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
        "`write_shard` (or `prepare_shard`, writing a shard it answered whole) found items "
        "of its shard that are neither succeeded nor dead.",
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
    FailureType.TABLE_ERROR: Explanation(
        "A Postgres table the job reads or writes failed in a way no retry cures (no such "
        "table or column, a refused login, a type that does not fit); the shard's items "
        "die as `ShardFailed`.",
        "Fix the table or the worker's database credentials (PGPASSWORD, a pgpass file), "
        "then re-drive with `--class ShardFailed`.",
    ),
    FailureType.TOO_MANY_BATCHES: Explanation(
        "An API batch's workflow was refused its record: its project already has "
        "`LLMBATCH_API_MAX_BATCHES_IN_PROGRESS` unfinished batches (the API answered 429).",
        "Wait for a batch of the project to finish, or raise the limit; nothing ran.",
    ),
    FailureType.BATCH_NOT_RECORDED: Explanation(
        "An API batch's workflow ended before running because its record was not written: "
        "it was started without the `create_api_batch` update (not by `llm-batch serve`), "
        "or the record was refused.",
        "Create batches through `POST /v1/batches`; the message says why the record was refused.",
    ),
    FailureType.WORKER_DRAINED: Explanation(
        "A GPU worker was stopped (SIGTERM: a spot notice, a scale-down, a deploy) while it "
        "ran the shard's generate step; it recorded what came back within its drain timeout "
        "and gave the rest back. Not an item failure: the step is retried on another worker "
        "and no item is charged an attempt.",
        "Nothing to do. Many of them: give workers a longer `--drain-timeout` (and the pod "
        "a longer grace period), or fewer preemptions.",
    ),
    FailureType.ENDPOINT_REFUSED: Explanation(
        "A remote endpoint refused the job's requests (its API key: 401/403; a model it "
        "does not serve), or gave no usable answer for too long (see the endpoint faults "
        "below). The job is paused with that reason in `status`; its items stay pending, "
        "none dies.",
        "Fix the key in the remote workers' environment (the variable the endpoint "
        "names), the job's model or the endpoint (`llm-batch endpoint update NAME "
        "--base-url ...`; running workers take it within seconds), then `llm-batch resume "
        "JOB_ID`.",
    ),
}

ENDPOINT_FAULT_HELP: dict[EndpointFault, Explanation] = {
    EndpointFault.UNREACHABLE: Explanation(
        "Nothing answered at the endpoint's base URL: the connection was refused, the host "
        "is not known, or TLS failed. Requests are sent again with backoff; a job whose "
        "requests get no answer for `LLMBATCH_REMOTE_PAUSE_AFTER_FAILING_S` (5 min) is paused.",
        "Check the base URL (`llm-batch endpoint show NAME`) and that the server runs; fix it "
        "with `llm-batch endpoint update NAME --base-url URL`, then resume the job.",
    ),
    EndpointFault.TIMEOUT: Explanation(
        "The endpoint did not answer within its timeout (`--timeout`, 600 s by default). "
        "Sent again with backoff; counts towards the pause as Unreachable does.",
        "Check the server's load; give long generations a longer `--timeout`.",
    ),
    EndpointFault.CONNECTION_DROPPED: Explanation(
        "The connection closed before the answer was complete (a server or proxy restart). "
        "Sent again with backoff; counts towards the pause as Unreachable does.",
        "Nothing, if it passes; else check the server and any proxy in front of it.",
    ),
    EndpointFault.SERVER_ERROR: Explanation(
        "The endpoint answered 5xx (but 503), 408, 409 or 425. Sent again with backoff "
        "(never longer than `LLMBATCH_REMOTE_MAX_RETRY_AFTER_S` when it asks for a wait); "
        "counts towards the pause as Unreachable does.",
        "Check the server's log; the message is the server's own.",
    ),
    EndpointFault.UNUSABLE_ANSWER: Explanation(
        "The endpoint answered 2xx with a body that is not JSON or not an answer (an HTML "
        "page of a proxy or a web server, a truncated body). Such answers may be paid for: "
        "after `LLMBATCH_REMOTE_MAX_UNUSABLE_ANSWERS` (20) of them in a row the job is paused.",
        "Check that the base URL points at the API (it usually ends in `/v1`): "
        "`llm-batch endpoint update NAME --base-url URL`, then resume the job.",
    ),
    EndpointFault.THROTTLED: Explanation(
        "The endpoint answered 429 or 503. Every worker of the endpoint waits what it asked "
        "for (`Retry-After`, at most `LLMBATCH_REMOTE_MAX_RETRY_AFTER_S`, 300 s) and the "
        "endpoint's send rate is halved; never a pause, never a dead item.",
        "Declare the endpoint's real limits (`--rpm`, `--tpm`); `llm-batch endpoint update "
        "NAME` lifts a wait at once.",
    ),
    EndpointFault.REFUSED: Explanation(
        "The endpoint refused the API key (401/403) or does not serve the model: the job is "
        "paused at once (failure type EndpointRefused).",
        "Fix the key or the model, then `llm-batch resume JOB_ID`.",
    ),
}
