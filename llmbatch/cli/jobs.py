"""Job commands: submit, status, results, schema."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from llmbatch.cli._support.common import (
    CliError,
    JobIdArgument,
    JsonOption,
    emit_json,
    err,
    job_url,
    out,
    run,
)
from llmbatch.cli._support.options import JobOptions, check_inputs, job_options, place_job
from llmbatch.contract.choices import DEFAULT_PRIORITY, EndpointVia, Task
from llmbatch.contract.progress import format_duration
from llmbatch.contract.states import ErrorClass, JobState

if TYPE_CHECKING:
    from temporalio.client import Client

    from llmbatch.config import Settings
    from llmbatch.contract.messages import JobProgress, JobSummary
    from llmbatch.contract.spec import JobSpec

app = typer.Typer()


# --- submit -------------------------------------------------------------------------


@app.command("submit")
@job_options
def submit(
    job: JobOptions,
    job_id: Annotated[str | None, typer.Option(help="Job id; default a new one.")] = None,
    wait: Annotated[
        bool, typer.Option(help="Wait, showing progress, then print the summary.")
    ] = False,
    as_json: JsonOption = False,
    require_worker: Annotated[
        bool,
        typer.Option(
            help="Refuse the job when no worker serves its model (default: warn and submit)."
        ),
    ] = False,
    attach: Annotated[
        bool,
        typer.Option(help="When the job id exists, follow that job even if its spec differs."),
    ] = False,
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="With --endpoint: count the job's tokens (after deduplication and the "
            "result cache) and print what it would cost at the endpoint's prices; sends "
            "nothing and starts no job.",
        ),
    ] = False,
) -> None:
    """Submit a batch job (validated before anything is scheduled)."""
    from llmbatch.config import Settings

    settings = Settings()
    spec = job.to_spec(settings, job_id=job_id)
    if not spec.job_id:
        spec = spec.model_copy(update={"job_id": _new_job_id()})
    if estimate:
        run(_estimate(spec, settings, as_json=as_json))
        return
    run(
        _submit(
            spec, settings, wait=wait, as_json=as_json, require_worker=require_worker, attach=attach
        )
    )


async def _refuse_other_spec(client: Client, spec: JobSpec) -> None:
    """A second submit of a job id follows the job only when it asks for the same job:
    following another spec's job with exit 0 would pass its results off as this one's."""
    from llmbatch.client.temporal import started_spec

    existing = await started_spec(client, spec.job_id)
    if existing is None:
        return
    # A job started without a job id (a bare spec from another client) runs under its
    # workflow id, which is this one: the same job id.
    existing = existing.model_copy(update={"job_id": existing.job_id or spec.job_id})
    ours, theirs = spec.model_dump(mode="json"), existing.model_dump(mode="json")
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        raise CliError(
            f"job {spec.job_id} exists with a different spec; use --attach to follow it or "
            f"pick another id (it differs in: {', '.join(differ)})"
        )


def _new_job_id() -> str:
    import secrets

    return f"job-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


async def _submit(
    spec: JobSpec,
    settings: Settings,
    *,
    wait: bool,
    as_json: bool,
    require_worker: bool,
    attach: bool,
) -> None:
    from llmbatch.cli._support.jobview import follow_job, print_summary
    from llmbatch.client.quotas import QuotaExceeded, check_quota
    from llmbatch.client.temporal import connect, start_job

    await check_inputs(spec, settings)
    spec = await place_job(spec, settings)
    client = await connect(settings)
    # Via batch, CPU workers wait for the provider: no engine worker is needed.
    if spec.via is not EndpointVia.BATCH:
        await _check_worker(
            client,
            spec.model,
            settings,
            require=require_worker,
            task=spec.task,
            endpoint=spec.remote_endpoint,
        )
    try:
        await check_quota(client, settings, spec)
    except QuotaExceeded as exc:
        raise CliError(str(exc)) from None
    handle, started = await start_job(client, spec, settings=settings)
    if not started and not attach:
        await _refuse_other_spec(client, spec)
    if as_json and not wait:
        emit_json({"job_id": spec.job_id, "started": started, "run_id": handle.run_id})
        return
    if not as_json:
        verb = "submitted" if started else "already exists, following"
        out.print(f"job [bold]{spec.job_id}[/bold] {verb}")
        out.print(f"  web ui: {job_url(settings, spec.job_id)}")
    if wait:
        summary = await follow_job(client, handle, settings=settings, quiet=as_json)
        print_summary(summary, as_json=as_json)


async def _estimate(spec: JobSpec, settings: Settings, *, as_json: bool) -> None:
    from llmbatch.cli._support.estimate import estimate
    from llmbatch.formats.planning import InvalidJobSpec
    from llmbatch.remote.endpoints import EndpointError

    await check_inputs(spec, settings)
    # The endpoint named, or the model's route: as submit would place the job.
    spec = await place_job(spec, settings)
    if spec.remote_endpoint is None:
        raise CliError(
            "--estimate prices a job on an endpoint: give --endpoint NAME (or a model "
            "routed to one)"
        )
    try:
        found = await estimate(spec, settings)
    except (EndpointError, InvalidJobSpec) as exc:  # removed since place_job looked
        raise CliError(str(exc)) from None
    if as_json:
        emit_json(found.as_dict())
        return
    out.print(f"job [bold]{spec.job_id}[/bold] estimate (nothing sent, no job started):")
    for line in found.lines():
        out.print(f"  {escape(line)}", highlight=False)


async def _check_worker(
    client: Client,
    model: str,
    settings: Settings,
    *,
    require: bool,
    task: Task = Task.GENERATE,
    endpoint: str | None = None,
) -> None:
    """A job for a model nobody serves would wait for a worker: say so before it starts."""
    from llmbatch.client.temporal import model_has_worker

    if await model_has_worker(client, settings, model, task=task, endpoint=endpoint):
        return
    queue = settings.gpu_task_queue(model, task, endpoint=endpoint)
    if require:
        flag = f" --task {task}" if task is not Task.GENERATE else ""
        start = (
            f"llm-batch worker remote --endpoint {endpoint} --model {model}{flag}"
            if endpoint is not None
            else f"llm-batch worker gpu --model {model}{flag}"
        )
        raise CliError(
            f"no worker serves model {model} (task queue {queue}); start one with "
            f"'{start}', or submit without --require-worker"
        )
    # Submitted anyway: a worker may be on its way (autoscaling, a restart).
    limit = format_duration(settings.generate_schedule_to_start.total_seconds())
    err.print(
        f"[yellow]warning:[/yellow] no worker serves model {escape(model)} yet (task queue "
        f"{queue}); the job waits for one up to {limit} per shard, then its items die as "
        f"{ErrorClass.NO_WORKER}",
        highlight=False,
    )


# --- status / results ---------------------------------------------------------------


@app.command("status")
def status(
    job_id: JobIdArgument,
    as_json: JsonOption = False,
) -> None:
    """Show a job's state, counts, tokens and throughput."""
    from llmbatch.config import Settings

    run(_status(Settings(), job_id, as_json=as_json))


async def _status(settings: Settings, job_id: str, *, as_json: bool) -> None:
    from llmbatch.cli._support.jobview import describe_job, usage_line
    from llmbatch.client.queues import describe_queue
    from llmbatch.client.temporal import connect, model_has_worker, started_spec

    # One client for every question status asks (connecting is most of its CPU).
    client = await connect(settings, tracing=False)
    workflow_state, p = await describe_job(client, settings, job_id)
    elapsed = _elapsed(p)
    rate = p.items_done / elapsed if elapsed else 0.0
    # The job's workflow cannot see pollers, so the CLI asks Temporal itself.
    waiting = False
    task = Task.GENERATE
    endpoint: str | None = None
    if p.state == JobState.RUNNING:
        # The task names the queue (an embed job waits on an embedding worker's).
        spec = await started_spec(client, job_id)
        task = spec.task if spec is not None else Task.GENERATE
        endpoint = spec.remote_endpoint if spec is not None else None
        waiting = not await model_has_worker(
            client, settings, p.model, task=task, endpoint=endpoint
        )
    queue = settings.gpu_task_queue(p.model, task, endpoint=endpoint)
    # Zero workers is a normal state (scaled to zero): say how long and how much waits.
    backlog = (await describe_queue(client, queue))[0] if waiting else None
    from llmbatch.provider.status import job_report_at, report_lines

    # Provider batches (jobs via batch): each one's status and counts, and the cost.
    provider = await job_report_at(settings.postgres_dsn.get_secret_value(), job_id)
    from llmbatch.remote.status import job_lines

    # Remote endpoints: what the job's requests did, their last error, any wait and why.
    remote_lines, remote = await job_lines(
        settings.postgres_dsn.get_secret_value(), job_id, items_done=p.items_done
    )
    if as_json:
        data = p.model_dump(mode="json")
        data.update(provider)
        data.update(remote=remote)
        data.update(workflow_status=workflow_state, items_per_s=rate, waiting_for_worker=waiting)
        if backlog is not None:
            data.update(
                task_queue=queue,
                queue_backlog=backlog["backlog"],
                waiting_s=backlog["backlog_age_s"],
            )
        emit_json(data)
        return
    out.print(f"[bold]{job_id}[/bold]: {p.state} (workflow {workflow_state})")
    out.print(f"  model: {p.model}")
    out.print(f"  {placement(p.priority, p.tenant)}", highlight=False)
    if backlog is not None:
        limit = format_duration(settings.generate_schedule_to_start.total_seconds())
        out.print(
            f"  [yellow]waiting for a worker serving {escape(p.model)}[/yellow]: none polls "
            f"task queue {queue}; its oldest task has waited "
            f"{format_duration(backlog['backlog_age_s'])}, {backlog['backlog']} task(s) "
            f"queued, {p.items_total - p.items_done} items of this job unfinished (a shard "
            f"waits up to {limit})",
            highlight=False,
        )
    out.print(f"  shards: {p.shards_done}/{p.shards_total} done, running {p.shards_running}")
    out.print(
        f"  items: {p.items_done}/{p.items_total} done "
        f"({p.items_succeeded} succeeded, {p.items_dead} dead)"
    )
    out.print(f"  tokens: {p.tokens.prompt} prompt, {p.tokens.completion} completion")
    out.print(f"  results: {usage_line(p.usage)}")
    for line in remote_lines:
        out.print(f"  {escape(line)}", highlight=False)
    for line in report_lines(provider):
        out.print(f"  {escape(line)}", highlight=False)
    out.print(f"  throughput: {rate:.1f} items/s over {elapsed:.0f} s")
    out.print(f"  web ui: {job_url(settings, job_id)}")


def placement(priority: int | None, tenant: str | None) -> str:
    """'priority 1, tenant team-a' as status shows it; the defaults say so."""
    shown = f"priority {priority}" if priority is not None else f"priority {DEFAULT_PRIORITY}"
    if priority is None:
        shown += " (default)"
    return shown + (f", tenant {tenant}" if tenant else ", no tenant")


def _elapsed(p: JobProgress | JobSummary) -> float:
    from llmbatch.contract.messages import JobSummary

    if isinstance(p, JobSummary) and p.elapsed_s:
        return p.elapsed_s
    if p.started_at is None:
        return 0.0
    return (datetime.now(UTC) - datetime.fromisoformat(p.started_at)).total_seconds()


@app.command("results")
def results(
    job_id: JobIdArgument,
    rows: Annotated[int, typer.Option("--rows", "-n", help="How many rows to show.")] = 5,
    as_json: JsonOption = False,
) -> None:
    """Say where a finished job's output is and show its first rows."""
    from llmbatch.cli._support.jobview import show_results
    from llmbatch.config import Settings

    run(show_results(Settings(), job_id, rows=rows, as_json=as_json))


# --- schema -------------------------------------------------------------------------


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of JobSpec, for services that start jobs in other languages."""
    from llmbatch.contract.spec import JobSpec

    emit_json(JobSpec.model_json_schema())
