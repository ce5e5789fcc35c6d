"""Job control commands: watch, list, cancel, pause, resume."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from llmbatch.cli._support.common import (
    DEFAULT_LINE_INTERVAL_S,
    CliError,
    JobIdArgument,
    JsonOption,
    emit_json,
    emit_json_line,
    find_job,
    job_url,
    out,
    run,
)
from llmbatch.contract.choices import DEFAULT_PRIORITY
from llmbatch.contract.names import BATCH_JOB_WORKFLOW, PAUSE_UPDATE, PROGRESS_QUERY, RESUME_UPDATE
from llmbatch.contract.progress import format_duration

if TYPE_CHECKING:
    from temporalio.client import (
        Client,
        WorkflowExecution,
        WorkflowExecutionStatus,
        WorkflowHandle,
    )

    from llmbatch.config import Settings
    from llmbatch.contract.messages import JobProgress

CANCEL_WAIT_S = 60.0
LIST_QUERY_TIMEOUT = timedelta(seconds=5)

app = typer.Typer()


# --- watch --------------------------------------------------------------------------


@app.command("watch")
def watch(
    job_id: JobIdArgument,
    interval: Annotated[
        float,
        typer.Option(
            help="Seconds between progress lines when stdout is not a terminal (and with --json)."
        ),
    ] = DEFAULT_LINE_INTERVAL_S,
    as_json: JsonOption = False,
) -> None:
    """Follow a job until it ends: a live bar in a terminal, periodic lines otherwise.

    With --json: one JSON object per line, progress records then the summary.
    """
    from llmbatch.config import Settings

    run(_watch(Settings(), job_id, interval_s=interval, as_json=as_json))


async def _watch(settings: Settings, job_id: str, *, interval_s: float, as_json: bool) -> None:
    from temporalio.client import WorkflowExecutionStatus

    from llmbatch.cli._support import progress
    from llmbatch.cli._support.jobview import follow_job, print_summary
    from llmbatch.client.temporal import connect

    client = await connect(settings, tracing=False)
    handle, description = await find_job(client, settings, job_id)
    if description.status not in (None, WorkflowExecutionStatus.RUNNING):
        if description.status != WorkflowExecutionStatus.COMPLETED:
            raise CliError(f"job {job_id} has ended: {_status_name(description.status)}")
        summary = await handle.result()
    else:
        if not as_json:
            out.print(f"watching job [bold]{job_id}[/bold]: {job_url(settings, job_id)}")
        view = progress.choose_view(out, as_json=as_json, interval_s=interval_s)
        summary = await follow_job(client, handle, settings=settings, quiet=False, view=view)
    if as_json:
        emit_json_line({"type": "summary", **summary.model_dump(mode="json")})
    else:
        print_summary(summary, as_json=False)


# --- list ---------------------------------------------------------------------------


@app.command("list")
def list_jobs(
    limit: Annotated[int, typer.Option(min=1, help="How many jobs, newest first.")] = 20,
    as_json: JsonOption = False,
) -> None:
    """List recent jobs: state, progress, dead items, model and age."""
    from llmbatch.config import Settings

    run(_list(Settings(), limit=limit, as_json=as_json))


async def _list(settings: Settings, *, limit: int, as_json: bool) -> None:
    import asyncio

    from llmbatch.client.temporal import connect

    client = await connect(settings)
    # A job that continued as new has one closed run per continuation: list the
    # live (or last) run only.
    query = f"WorkflowType = '{BATCH_JOB_WORKFLOW}' AND ExecutionStatus != 'ContinuedAsNew'"
    executions = [e async for e in client.list_workflows(query, limit=limit)]
    rows = await asyncio.gather(*(_job_row(client, e) for e in executions))
    if as_json:
        emit_json(rows)
        return
    if not rows:
        out.print(f"no jobs in namespace {settings.temporal_namespace}")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("job", "state", "progress", "dead", "model", "pri", "tenant", "age"):
        table.add_column(column, no_wrap=column == "job")
    for row in rows:
        done, total = row["items_done"], row["items_total"]
        share = f" {100 * done // total}%" if total else ""
        table.add_row(
            row["job_id"],
            row["state"],
            f"{done}/{total}{share}",
            str(row["items_dead"]),
            row["model"] or "",
            str(row["priority"] or DEFAULT_PRIORITY),
            row["tenant"] or "",
            format_duration(row["age_s"]),
        )
    out.print(table)


async def _job_row(client: Client, execution: WorkflowExecution) -> dict[str, Any]:
    """One job as `list` shows it: visibility's counts (updated coarsely by the job),
    refined for running jobs by their progress query, which also knows "paused"."""
    from temporalio.client import WorkflowExecutionStatus

    from llmbatch.contract import search_attributes as sa

    attrs = execution.typed_search_attributes
    status = _status_name(execution.status)
    row: dict[str, Any] = {
        "job_id": attrs.get(sa.JOB_ID) or execution.id,
        "status": status,
        "state": status,
        "model": attrs.get(sa.MODEL),
        "items_total": attrs.get(sa.ITEMS_TOTAL) or 0,
        "items_done": attrs.get(sa.ITEMS_DONE) or 0,
        "items_dead": attrs.get(sa.ITEMS_DEAD) or 0,
        # None: the job runs at Temporal's default priority, without a tenant.
        "priority": _int_or_none(attrs.get(sa.JOB_PRIORITY)),
        "tenant": attrs.get(sa.TENANT),
        "started_at": execution.start_time.isoformat() if execution.start_time else None,
        "closed_at": execution.close_time.isoformat() if execution.close_time else None,
        "age_s": None,
    }
    started = execution.start_time
    if execution.status == WorkflowExecutionStatus.COMPLETED:
        # A job that ended otherwise than its workflow's status says (an API batch
        # that expired completes its workflow) names its state in the memo.
        memo = await execution.memo()
        if isinstance(memo.get("state"), str):
            row["state"] = memo["state"]
    if execution.status == WorkflowExecutionStatus.RUNNING:
        live = await _query_quietly(client.get_workflow_handle(execution.id))
        if live is not None:
            row.update(
                state=live.state,
                items_total=live.items_total,
                items_done=live.items_done,
                items_dead=live.items_dead,
                model=live.model or row["model"],
                priority=live.priority or row["priority"],
                tenant=live.tenant or row["tenant"],
            )
            if live.started_at:  # the job's own start, across continue-as-new
                started = datetime.fromisoformat(live.started_at)
                row["started_at"] = live.started_at
    if started is not None:
        row["age_s"] = (datetime.now(UTC) - started).total_seconds()
    return row


async def _query_quietly(handle: WorkflowHandle[Any, Any]) -> JobProgress | None:
    from llmbatch.contract.messages import JobProgress

    try:
        return await handle.query(
            PROGRESS_QUERY, result_type=JobProgress, rpc_timeout=LIST_QUERY_TIMEOUT
        )
    except Exception:  # no worker, or the run just ended: visibility's counts will do
        return None


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _status_name(status: WorkflowExecutionStatus | None) -> str:
    return status.name.lower() if status is not None else "unknown"


# --- cancel -------------------------------------------------------------------------


@app.command("cancel")
def cancel(
    job_id: JobIdArgument,
    as_json: JsonOption = False,
) -> None:
    """Cancel a job: its shards stop, in-flight engine requests are aborted, and every
    item finished so far stays in the ledger."""
    from llmbatch.config import Settings

    run(_cancel(Settings(), job_id, as_json=as_json))


async def _cancel(settings: Settings, job_id: str, *, as_json: bool) -> None:
    from temporalio.client import WorkflowExecutionStatus

    from llmbatch.client.temporal import connect

    client = await connect(settings)
    handle, description = await find_job(client, settings, job_id)
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise CliError(
            f"job {job_id} is not running ({_status_name(description.status)}); nothing to cancel"
        )
    before = await _query_quietly(handle)
    await handle.cancel()
    status = await _wait_closed(handle, within_s=CANCEL_WAIT_S)
    data: dict[str, Any] = {"job_id": job_id, "status": status}
    if before is not None:
        data.update(items_total=before.items_total, items_done=before.items_done)
    if as_json:
        emit_json(data)
        return
    if status == "running":
        out.print(f"job [bold]{job_id}[/bold]: cancel requested; it is still stopping")
    else:
        out.print(f"job [bold]{job_id}[/bold]: {status}")
    if before is not None:
        out.print(
            f"  {before.items_done}/{before.items_total} items were done in finished shards; "
            "running shards stop and keep what they finished in the ledger"
        )


async def _wait_closed(handle: WorkflowHandle[Any, Any], *, within_s: float) -> str:
    """The job's status once it is no longer running, or "running" after ``within_s``."""
    import asyncio

    from temporalio.client import WorkflowExecutionStatus

    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return _status_name(description.status)
        if asyncio.get_running_loop().time() >= deadline:
            return "running"
        await asyncio.sleep(0.5)


# --- pause / resume -----------------------------------------------------------------


@app.command("pause")
def pause(
    job_id: JobIdArgument,
    as_json: JsonOption = False,
) -> None:
    """Pause a job: no new shards and no new engine requests start (those in the
    engine finish). Resume with `llm-batch resume JOB`."""
    from llmbatch.config import Settings

    run(_control(Settings(), job_id, PAUSE_UPDATE, as_json=as_json))


@app.command("resume")
def resume(
    job_id: JobIdArgument,
    as_json: JsonOption = False,
) -> None:
    """Resume a paused job."""
    from llmbatch.config import Settings

    run(_control(Settings(), job_id, RESUME_UPDATE, as_json=as_json))


async def _control(settings: Settings, job_id: str, update: str, *, as_json: bool) -> None:
    from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError

    from llmbatch.client.temporal import connect
    from llmbatch.contract.messages import JobControlState

    client = await connect(settings)
    handle, description = await find_job(client, settings, job_id)
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise CliError(
            f"cannot {update} job {job_id}: it is not running ({_status_name(description.status)})"
        )
    try:
        state = await handle.execute_update(update, result_type=JobControlState)
    except WorkflowUpdateFailedError as exc:  # refused by the job's validator, or failed
        cause = exc.cause
        message = getattr(cause, "message", None) or str(cause or exc)
        raise CliError(message) from None
    if as_json:
        emit_json(state.model_dump(mode="json"))
        return
    if state.paused:
        out.print(
            f"job [bold]{job_id}[/bold] paused: no new shards or engine requests start; "
            f"those under way finish. Resume with: llm-batch resume {job_id}"
        )
    else:
        out.print(f"job [bold]{job_id}[/bold] resumed ({state.state})")
