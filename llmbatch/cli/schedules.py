"""``llm-batch schedule create|list|trigger|delete``: recurring jobs on Temporal Schedules.

``create`` takes the same job options as ``submit`` (both from
:mod:`llmbatch.cli._support.options`) except ``--job-id``: each run's job id is
``<name>-<scheduled UTC time>``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from llmbatch.cli._support.common import CliError, JsonOption, emit_json, fail, out, run
from llmbatch.cli._support.options import JobOptions, check_inputs, job_options, place_job

if TYPE_CHECKING:
    from temporalio.client import ScheduleOverlapPolicy

    from llmbatch.client import schedules
    from llmbatch.config import Settings
    from llmbatch.contract.spec import JobSpec

app = typer.Typer(
    name="schedule", help="Recurring jobs on Temporal Schedules.", no_args_is_help=True
)

T = TypeVar("T")


class Overlap(enum.StrEnum):
    """What to do when a run is due while the previous one still works."""

    SKIP = "skip"
    BUFFER_ONE = "buffer-one"
    BUFFER_ALL = "buffer-all"
    CANCEL_OTHER = "cancel-other"
    ALLOW_ALL = "allow-all"

    @property
    def policy(self) -> ScheduleOverlapPolicy:
        from temporalio.client import ScheduleOverlapPolicy

        return ScheduleOverlapPolicy[self.name]


async def _guard(call: Awaitable[T]) -> T:
    """Schedule errors become the CLI's one-line errors."""
    from llmbatch.client import schedules

    try:
        return await call
    except schedules.ScheduleError as exc:
        raise CliError(str(exc)) from None


@app.command("create")
@job_options
def create(
    name: Annotated[str, typer.Argument(help="Schedule name; runs are '<name>-<UTC time>'.")],
    cron: Annotated[
        list[str],
        typer.Option(help="Cron expression, e.g. '0 2 * * *' (02:00 daily); repeat for more."),
    ],
    job: JobOptions,
    timezone: Annotated[
        str | None, typer.Option(help="IANA time zone of the cron times; default UTC.")
    ] = None,
    overlap: Annotated[
        Overlap, typer.Option(help="When a run is due while the last one still works.")
    ] = Overlap.SKIP,
    paused: Annotated[bool, typer.Option(help="Create it paused.")] = False,
    note: Annotated[str, typer.Option(help="A note shown with the schedule.")] = "",
    check: Annotated[
        bool,
        typer.Option(help="Check the inputs now, as submit does; --no-check if they come later."),
    ] = True,
    as_json: JsonOption = False,
) -> None:
    """Run a job on a cron schedule; every run is a new job."""
    from llmbatch.client import schedules
    from llmbatch.config import Settings

    try:
        schedules.check_name(name)  # before the slower spec and input checks
    except schedules.ScheduleError as exc:
        raise fail(str(exc)) from None
    settings = Settings()
    spec = job.to_spec(settings)
    run(
        _create(
            settings,
            name,
            spec,
            cron=cron,
            timezone=timezone,
            overlap=overlap,
            paused=paused,
            note=note,
            check=check,
            as_json=as_json,
        )
    )


async def _create(
    settings: Settings,
    name: str,
    spec: JobSpec,
    *,
    cron: list[str],
    timezone: str | None,
    overlap: Overlap,
    paused: bool,
    note: str,
    check: bool,
    as_json: bool,
) -> None:
    from llmbatch.client import schedules
    from llmbatch.client.temporal import connect

    if check:
        await check_inputs(spec, settings)
    # The endpoint is settled now, once: each run starts the spec as stored.
    spec = await place_job(spec, settings)
    client = await connect(settings)
    await _guard(
        schedules.create_schedule(
            client,
            name,
            spec,
            cron=cron,
            settings=settings,
            timezone=timezone,
            overlap=overlap.policy,
            paused=paused,
            note=note,
        )
    )
    summary = await _guard(schedules.describe_schedule(client, name))
    if as_json:
        emit_json(summary.model_dump(mode="json"))
        return
    out.print(f"schedule [bold]{name}[/bold] created: {_when(summary)}")
    out.print(f"  each run is a new job named {name}-<scheduled UTC time>")
    if summary.paused:
        out.print("  paused: no runs until it is unpaused (in the Web UI's Schedules page)")
    elif summary.next_runs:
        out.print(f"  next run: {summary.next_runs[0]}")


@app.command("list")
def list_(as_json: JsonOption = False) -> None:
    """List the schedules that start llm-batch jobs."""
    from llmbatch.config import Settings

    run(_list(Settings(), as_json=as_json))


async def _list(settings: Settings, *, as_json: bool) -> None:
    from llmbatch.client import schedules
    from llmbatch.client.temporal import connect

    client = await connect(settings)
    found = await _guard(schedules.list_schedules(client))
    if as_json:
        emit_json([s.model_dump(mode="json") for s in found])
        return
    if not found:
        out.print("no schedules")
        return
    for s in found:
        state = " [yellow](paused)[/yellow]" if s.paused else ""
        on = f" on endpoint {s.endpoint}" if s.endpoint else ""
        out.print(f"[bold]{s.name}[/bold]{state}: {_when(s)}; model {s.model}{on}")
        out.print(f"  inputs: {', '.join(s.inputs)} -> {s.output_uri}")
        out.print(f"  next run: {s.next_runs[0] if s.next_runs else 'none'}")
        if s.recent_runs:
            out.print(f"  last job: {s.recent_runs[-1].job_id}")


@app.command("trigger")
def trigger(
    name: Annotated[str, typer.Argument(help="The schedule's name.")],
    as_json: JsonOption = False,
) -> None:
    """Start a run of the schedule now (a new job, as a scheduled run is)."""
    from llmbatch.config import Settings

    run(_trigger(Settings(), name, as_json=as_json))


async def _trigger(settings: Settings, name: str, *, as_json: bool) -> None:
    from llmbatch.client import schedules
    from llmbatch.client.temporal import connect

    client = await connect(settings)
    await _guard(schedules.trigger_schedule(client, name))
    if as_json:
        emit_json({"name": name, "triggered": True})
    else:
        out.print(f"schedule [bold]{name}[/bold] triggered; see llm-batch schedule list")


@app.command("delete")
def delete(
    name: Annotated[str, typer.Argument(help="The schedule's name.")],
    as_json: JsonOption = False,
) -> None:
    """Delete a schedule; jobs it started go on."""
    from llmbatch.config import Settings

    run(_delete(Settings(), name, as_json=as_json))


async def _delete(settings: Settings, name: str, *, as_json: bool) -> None:
    from llmbatch.client import schedules
    from llmbatch.client.temporal import connect

    client = await connect(settings)
    await _guard(schedules.delete_schedule(client, name))
    if as_json:
        emit_json({"name": name, "deleted": True})
    else:
        out.print(f"schedule [bold]{name}[/bold] deleted")


def _when(s: schedules.ScheduleSummary) -> str:
    return f"cron {' | '.join(s.cron)} ({s.timezone or 'UTC'})"
