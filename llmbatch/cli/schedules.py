"""``llm-batch schedule create|list|trigger|delete``: recurring jobs on Temporal Schedules.

``create`` takes the same job options as ``submit`` (the spec is built by the same
code) except ``--job-id``: each run's job id is ``<name>-<scheduled UTC time>``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from temporalio.client import ScheduleOverlapPolicy

from llmbatch import schedules
from llmbatch.cli.jobs import CliError, build_spec, check_inputs, emit_json, fail, out, run
from llmbatch.client import connect
from llmbatch.config import Settings
from llmbatch.contract.spec import InputFormat, JobSpec, OutputFormat

app = typer.Typer(no_args_is_help=True)

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
        return ScheduleOverlapPolicy[self.name]


async def _guard(call: Awaitable[T]) -> T:
    """Schedule errors become the CLI's one-line errors."""
    try:
        return await call
    except schedules.ScheduleError as exc:
        raise CliError(str(exc)) from None


@app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="Schedule name; runs are '<name>-<UTC time>'.")],
    cron: Annotated[
        list[str],
        typer.Option(help="Cron expression, e.g. '0 2 * * *' (02:00 daily); repeat for more."),
    ],
    inputs: Annotated[list[str], typer.Option("--input", "-i", help="Input URI or path; repeat.")],
    model: Annotated[str, typer.Option(help="Hugging Face model id or local path.")],
    output: Annotated[
        str | None, typer.Option(help="Output URI; default s3://<bucket>/results.")
    ] = None,
    messages_file: Annotated[
        Path | None, typer.Option("--messages", help="JSON file: [{role, content}, ...].")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System message template.")] = None,
    user: Annotated[
        str | None, typer.Option(help="User message template, e.g. '{{ text }}'.")
    ] = None,
    input_format: Annotated[InputFormat | None, typer.Option("--format")] = None,
    id_field: Annotated[str | None, typer.Option(help="Row field with the item id.")] = None,
    temperature: Annotated[float | None, typer.Option()] = None,
    top_p: Annotated[float | None, typer.Option()] = None,
    max_tokens: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeat.")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    choices: Annotated[str | None, typer.Option(help="Comma-separated allowed answers.")] = None,
    json_schema: Annotated[
        Path | None, typer.Option(help="JSON Schema file the output must match.")
    ] = None,
    regex: Annotated[str | None, typer.Option(help="Regex the output must match.")] = None,
    output_format: Annotated[OutputFormat, typer.Option()] = OutputFormat.JSONL,
    shard_size: Annotated[int | None, typer.Option(help="Rows per shard.")] = None,
    max_concurrent_shards: Annotated[int | None, typer.Option()] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A whole JobSpec as JSON; options override it.")
    ] = None,
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
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a job on a cron schedule; every run is a new job."""
    try:
        schedules.check_name(name)  # before the slower spec and input checks
    except schedules.ScheduleError as exc:
        raise fail(str(exc)) from None
    settings = Settings()
    spec = build_spec(
        settings,
        inputs=inputs,
        model=model,
        output=output,
        job_id=None,
        messages_file=messages_file,
        system=system,
        user=user,
        input_format=input_format,
        id_field=id_field,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        choices=choices,
        json_schema=json_schema,
        regex=regex,
        output_format=output_format,
        shard_size=shard_size,
        max_concurrent_shards=max_concurrent_shards,
        spec_file=spec_file,
    )
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
    if check:
        await check_inputs(spec, settings)
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
def list_(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the schedules that start llm-batch jobs."""
    run(_list(Settings(), as_json=as_json))


async def _list(settings: Settings, *, as_json: bool) -> None:
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
        out.print(f"[bold]{s.name}[/bold]{state}: {_when(s)}; model {s.model}")
        out.print(f"  inputs: {', '.join(s.inputs)} -> {s.output_uri}")
        out.print(f"  next run: {s.next_runs[0] if s.next_runs else 'none'}")
        if s.recent_runs:
            out.print(f"  last job: {s.recent_runs[-1].job_id}")


@app.command("trigger")
def trigger(
    name: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Start a run of the schedule now (a new job, as a scheduled run is)."""
    run(_trigger(Settings(), name, as_json=as_json))


async def _trigger(settings: Settings, name: str, *, as_json: bool) -> None:
    client = await connect(settings)
    await _guard(schedules.trigger_schedule(client, name))
    if as_json:
        emit_json({"name": name, "triggered": True})
    else:
        out.print(f"schedule [bold]{name}[/bold] triggered; see llm-batch schedule list")


@app.command("delete")
def delete(
    name: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Delete a schedule; jobs it started go on."""
    run(_delete(Settings(), name, as_json=as_json))


async def _delete(settings: Settings, name: str, *, as_json: bool) -> None:
    client = await connect(settings)
    await _guard(schedules.delete_schedule(client, name))
    if as_json:
        emit_json({"name": name, "deleted": True})
    else:
        out.print(f"schedule [bold]{name}[/bold] deleted")


def _when(s: schedules.ScheduleSummary) -> str:
    return f"cron {' | '.join(s.cron)} ({s.timezone or 'UTC'})"
