"""How a job is shown: its state, following it to the end, its summary, its results.

Shared by the job, control and demo commands, which import it when they run (it
imports Temporal and the contract's models).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from temporalio.api.failure.v1 import Failure
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.exceptions import CancelledError
from temporalio.service import RPCError

from llmbatch import ledger
from llmbatch.cli._support import progress
from llmbatch.cli._support.common import CliError, emit_json, failure_message, find_job, out
from llmbatch.client.temporal import connect
from llmbatch.config import Settings
from llmbatch.contract import search_attributes as sa
from llmbatch.contract.dead_letters import DeadLetterView
from llmbatch.contract.messages import JobProgress, JobSummary, Usage
from llmbatch.contract.names import DEAD_LETTERS_QUERY, PROGRESS_QUERY, dead_letter_workflow_id
from llmbatch.contract.states import JobState
from llmbatch.security.codec import DECRYPT_HINT, DECRYPT_HINT_MARK, DecryptError

if TYPE_CHECKING:
    from llmbatch.ledger.db import Database
    from llmbatch.storage.base import ObjectStore


class RecordedProgress:
    """A running job's progress with what its running shards have recorded so far,
    read from the ledger: the job's workflow counts a shard's items when the shard ends
    (and between, at most every ``progress_every``), while its items are recorded as
    they come. One indexed query of the running shards' items a reading, on one
    connection held while the CLI follows the job; the job's size does not matter."""

    def __init__(self, settings: Settings) -> None:
        self._dsn = settings.postgres_dsn.get_secret_value()
        self._pool: Database | None = None

    async def __aenter__(self) -> RecordedProgress:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def read(self, p: JobProgress) -> JobProgress:
        """``p`` with its running shards' counts as the ledger has them now."""
        if isinstance(p, JobSummary) or not p.shards_running:
            return p
        if self._pool is None:
            self._pool = await ledger.db.create_pool(
                self._dsn, min_size=0, max_size=1, connect_timeout_s=10, command_timeout_s=10
            )
        counts = await ledger.jobs.shard_counts(
            self._pool, job_id=p.job_id, shards=p.shards_running
        )
        return p.with_running_items(counts)


async def describe_job(
    client: Client, settings: Settings, job_id: str
) -> tuple[str, JobProgress | JobSummary]:
    """The job's workflow state and its summary (ended) or progress (running, with
    what its running shards have recorded so far)."""
    handle, description = await find_job(client, settings, job_id)
    state = description.status.name.lower() if description.status else "unknown"
    if description.status == WorkflowExecutionStatus.COMPLETED:
        summary = await handle.result()
        if summary.items_dead:
            # Re-drives of dead items finalize the job again; the newest summary is
            # the dead-letter workflow's, the workflow result is the first one.
            dlq = client.get_workflow_handle(dead_letter_workflow_id(job_id))
            with contextlib.suppress(RPCError):  # gone past its retention: keep the result
                view = await dlq.query(DEAD_LETTERS_QUERY, result_type=DeadLetterView)
                summary = view.job or summary
        return state, summary
    if description.status == WorkflowExecutionStatus.RUNNING:
        try:
            running = await handle.query(PROGRESS_QUERY, result_type=JobProgress)
        except (WorkflowQueryFailedError, RPCError) as exc:
            # Temporal answers "Workflow Task in failed state" while the job's workflow
            # task keeps failing: its own failure says why (after `codec-key rotate`,
            # the key a worker lacks), which is what the operator needs.
            failure = await last_task_failure(client, handle)
            if failure is None:
                raise
            raise CliError(
                f"job {job_id} is stuck: its workflow task fails on the CPU workers: {failure}"
            ) from exc
        async with RecordedProgress(settings) as recorded:
            return state, await recorded.read(running)
    # Cancelled before it could say so itself, or terminated, or timed out.
    ended = (
        JobState.CANCELLED
        if description.status == WorkflowExecutionStatus.CANCELED
        else JobState.FAILED
    )
    attributes = description.typed_search_attributes
    priority = attributes.get(sa.JOB_PRIORITY)
    return state, JobProgress(
        job_id=job_id,
        model=attributes.get(sa.MODEL) or "",
        state=ended,
        priority=int(priority) if priority and priority.isdigit() else None,
        tenant=attributes.get(sa.TENANT),
    )


DECRYPT_ERROR_TYPE = DecryptError.__name__


async def last_task_failure(client: Client, handle: WorkflowHandle[Any, Any]) -> str | None:
    """The failure of the workflow's latest workflow task, if that task failed (a
    worker could not decode its input, a bug in workflow code); else None."""
    failed: Failure | None = None
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_task_failed_event_attributes"):
            failed = event.workflow_task_failed_event_attributes.failure
        elif event.HasField("workflow_task_completed_event_attributes"):
            failed = None
    if failed is None:
        return None
    kind = failed.application_failure_info.type or "failure"
    try:
        # With a codec the message is encrypted (under the failing worker's key).
        message = str(await client.data_converter.decode_failure(failed))
    except Exception:  # this CLI lacks that key too
        message = f"{kind} (its message is encrypted under a key this CLI does not hold)"
    if DECRYPT_HINT_MARK in message or kind == DECRYPT_ERROR_TYPE:
        message += f"; {DECRYPT_HINT}"
    return message


async def follow_job(
    client: Client,
    handle: WorkflowHandle[Any, JobSummary],
    *,
    settings: Settings,
    quiet: bool,
    view: progress.ProgressView | None = None,
) -> JobSummary:
    """Show progress until the job ends (a bar in a terminal, lines otherwise, nothing
    when ``quiet``); return its summary. A failed or cancelled job is a CliError."""
    if view is None:
        view = progress.QuietView() if quiet else progress.choose_view(out, as_json=False)
    try:
        async with RecordedProgress(settings) as recorded:
            return await progress.follow(handle, view, recorded=recorded.read)
    except WorkflowFailureError as exc:
        if isinstance(exc.cause, CancelledError):
            raise CliError(f"job {handle.id} was cancelled") from exc
        raise CliError(f"job {handle.id} failed: {failure_message(exc)}") from exc


def print_summary(summary: JobSummary, *, as_json: bool) -> None:
    """A finished job's summary: counts, tokens, time, where its output is."""
    if as_json:
        emit_json(summary.model_dump(mode="json"))
        return
    rate = summary.items_done / summary.elapsed_s if summary.elapsed_s else 0.0
    out.print(f"[bold]{summary.job_id}[/bold]: {summary.state}")
    out.print(
        f"  items: {summary.items_total} total, {summary.items_succeeded} succeeded, "
        f"{summary.items_dead} dead"
    )
    out.print(f"  tokens: {summary.tokens.prompt} prompt, {summary.tokens.completion} completion")
    out.print(f"  results: {usage_line(summary.usage)}")
    out.print(f"  time: {summary.elapsed_s:.1f} s ({rate:.1f} items/s)")
    out.print(f"  output: {summary.output_root}/")
    out.print(f"  manifest: {summary.manifest}")


def usage_line(usage: Usage) -> str:
    """Where results came from (and the tokens reused), GPU time and cost: one line."""
    return usage.describe()


async def show_results(settings: Settings, job_id: str, *, rows: int, as_json: bool) -> None:
    """Where a finished job's output is, and its first ``rows`` rows."""
    # The object store's clients load only here: `status` never reads the output.
    from llmbatch import storage

    state, p = await describe_job(await connect(settings), settings, job_id)
    if not isinstance(p, JobSummary):
        raise CliError(f"job {job_id} has no results yet (workflow {state})")
    store = storage.stores.open_store(p.manifest, settings)
    manifest = json.loads(await asyncio.to_thread(store.read_bytes, p.manifest))
    first = await asyncio.to_thread(_first_rows, store, manifest["output_parts"], rows)
    if as_json:
        emit_json({"manifest": p.manifest, **manifest, "rows": first})
        return
    out.print(f"[bold]{job_id}[/bold]: {p.state}; output under {p.output_root}/")
    if manifest.get("output_table"):
        # A table output: its rows are in the database, one per item.
        out.print(f"  results upserted into {manifest['output_table']}")
    for part in manifest["output_parts"]:
        out.print(f"  {part}")
    for part in manifest["error_parts"]:
        out.print(f"  {part} (errors)")
    out.print(f"first {len(first)} rows:")
    for row in first:
        out.print_json(data=row)


def _first_rows(store: ObjectStore, parts: list[str], limit: int) -> list[dict[str, Any]]:
    from llmbatch import formats

    found: list[dict[str, Any]] = []
    for part in parts:
        if len(found) >= limit:
            break
        data = store.read_bytes(part)
        reader = (
            formats.read_parquet_bytes if part.endswith(".parquet") else formats.read_jsonl_bytes
        )
        found.extend(list(reader(data))[: limit - len(found)])
    return found
