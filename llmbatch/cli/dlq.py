"""Dead-letter commands: ``llm-batch dlq list JOB`` and ``llm-batch dlq redrive JOB``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmbatch.cli._support.common import (
    CliError,
    JobIdArgument,
    JsonOption,
    emit_json,
    failure_message,
    find_job,
    out,
    run,
)
from llmbatch.contract.names import DEAD_LETTERS_QUERY, REDRIVE_UPDATE, dead_letter_workflow_id
from llmbatch.contract.states import ErrorClass

if TYPE_CHECKING:
    from temporalio.client import Client

    from llmbatch.config import Settings
    from llmbatch.contract.dead_letters import DeadLetterView, RedriveRequest

app = typer.Typer(
    name="dlq", help="A job's dead items: list them, re-drive them.", no_args_is_help=True
)


@app.command("list")
def list_command(
    job_id: JobIdArgument,
    error_class: Annotated[
        list[ErrorClass] | None, typer.Option("--class", help="Only this error class; repeat.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """List a job's dead items: id, error class, message, attempts, source line."""
    from llmbatch.config import Settings

    run(_list(Settings(), job_id, classes=error_class, as_json=as_json))


@app.command("redrive")
def redrive_command(
    job_id: JobIdArgument,
    ids: Annotated[
        list[str] | None, typer.Option("--ids", help="Item ids, comma-separated; repeat.")
    ] = None,
    error_class: Annotated[
        list[ErrorClass] | None, typer.Option("--class", help="Items of this error class; repeat.")
    ] = None,
    settings_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Sampling field (an embed job's: embed option) for the re-drive, "
            "key=value; repeat.",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Run dead items again (all, or the given ids or classes); wait for the outcome."""
    from llmbatch.config import Settings
    from llmbatch.contract.dead_letters import RedriveRequest

    item_ids = [i.strip() for value in ids or [] for i in value.split(",") if i.strip()] or None
    request = RedriveRequest(
        item_ids=item_ids,
        error_classes=error_class or None,
        sampling=_parse_sets(settings_ or []),
    )
    run(_redrive(Settings(), job_id, request, as_json=as_json))


def _parse_sets(values: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; a value is JSON when it parses as JSON (numbers, lists),
    else a plain string."""
    parsed: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set needs key=value, got {item!r}")
        try:
            parsed[key.strip()] = json.loads(raw)
        except ValueError:
            parsed[key.strip()] = raw
    return parsed


async def _view(client: Client, settings: Settings, job_id: str) -> DeadLetterView | None:
    """The job's dead-letter list, or None when no item of it ever died."""
    from temporalio.service import RPCError, RPCStatusCode

    from llmbatch.contract.dead_letters import DeadLetterView

    await find_job(client, settings, job_id)  # a clear error for an unknown job
    handle = client.get_workflow_handle(dead_letter_workflow_id(job_id))
    try:
        return await handle.query(DEAD_LETTERS_QUERY, result_type=DeadLetterView)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        if "no poller" in (exc.message or ""):
            # Queries are answered by a worker that runs the workflow's code.
            raise CliError(
                f"no CPU worker polls {settings.cpu_task_queue} to answer for the dead-letter "
                "list; start one with: llm-batch worker cpu"
            ) from None
        raise


async def _list(
    settings: Settings, job_id: str, *, classes: list[ErrorClass] | None, as_json: bool
) -> None:
    from llmbatch.client.temporal import connect
    from llmbatch.contract.dead_letters import DeadLetterView

    client = await connect(settings, tracing=False)
    view = await _view(client, settings, job_id)
    if view is None:
        view = DeadLetterView(
            job_id=job_id,
            dead=0,
            by_class={},
            entries=[],
            listed_all=True,
            job=None,
            redrives=[],
            redriving=False,
        )
    entries = [e for e in view.entries if not classes or e.error_class in classes]
    if as_json:
        emit_json(
            {
                **view.model_dump(mode="json", exclude={"entries"}),
                "entries": [e.model_dump(mode="json") for e in entries],
            }
        )
        return
    if view.dead == 0:
        out.print(f"job {job_id} has no dead items")
        return
    classes_line = ", ".join(f"{c} {n}" for c, n in sorted(view.by_class.items()))
    out.print(f"[bold]{job_id}[/bold]: {view.dead} dead ({classes_line})")
    for e in entries:
        out.print(
            f"  {e.item_id}  [red]{e.error_class}[/red]  {e.source or '-'}  "
            f"attempts {e.attempts}: {e.message}",
            highlight=False,
        )
    if not view.listed_all:
        errors = f"{view.job.output_root}/errors/" if view.job else "the errors/ folder"
        out.print(f"  (only part of the list is kept here; every dead item is in {errors})")
    for r in view.redrives:
        out.print(
            f"  re-drive {r.redrive}: {r.requeued} requeued, {r.succeeded} succeeded, "
            f"{r.dead} dead again"
        )


async def _redrive(
    settings: Settings, job_id: str, request: RedriveRequest, *, as_json: bool
) -> None:
    from temporalio.client import WorkflowUpdateFailedError

    from llmbatch.client.temporal import connect
    from llmbatch.contract.dead_letters import RedriveResult

    client = await connect(settings)
    if await _view(client, settings, job_id) is None:
        raise CliError(f"job {job_id} has no dead items to re-drive")
    handle = client.get_workflow_handle(dead_letter_workflow_id(job_id))
    if not as_json:
        out.print(f"re-driving dead items of {job_id} (waits until they are done) ...")
    try:
        result = await handle.execute_update(REDRIVE_UPDATE, request, result_type=RedriveResult)
    except WorkflowUpdateFailedError as exc:
        raise CliError(f"re-drive refused: {failure_message(exc)}") from None
    if as_json:
        emit_json(result.model_dump(mode="json"))
        return
    out.print(
        f"re-drive {result.redrive}: {result.requeued} requeued, {result.succeeded} succeeded, "
        f"{result.dead} dead again (shards {result.shards})"
    )
