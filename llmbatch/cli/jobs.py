"""Job commands: submit, status, results, schema."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError
from temporalio.service import RPCError

from llmbatch import planning, storage
from llmbatch.cli import progress
from llmbatch.cli.common import (
    CliError,
    emit_json,
    fail,
    failure_message,
    find_job,
    job_url,
    out,
    run,
)
from llmbatch.client import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import DeadLetterView
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import DEAD_LETTERS_QUERY, PROGRESS_QUERY, dead_letter_workflow_id
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec, OutputFormat
from llmbatch.contract.states import JobState

# Re-exported for the other command modules (demo).
__all__ = ["CliError", "emit_json", "fail", "out", "register", "run"]


def register(app: typer.Typer) -> None:
    """Add the job commands to the top-level app."""
    app.command("submit")(submit)
    app.command("status")(status)
    app.command("results")(results)
    app.command("schema")(schema)


# --- submit -------------------------------------------------------------------------


def submit(
    inputs: Annotated[list[str], typer.Option("--input", "-i", help="Input URI or path; repeat.")],
    model: Annotated[str, typer.Option(help="Hugging Face model id or local path.")],
    output: Annotated[
        str | None, typer.Option(help="Output URI; default s3://<bucket>/results.")
    ] = None,
    job_id: Annotated[str | None, typer.Option(help="Job id; default a new one.")] = None,
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
    wait: Annotated[
        bool, typer.Option(help="Wait, showing progress, then print the summary.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Submit a batch job (validated before anything is scheduled)."""
    settings = Settings()
    spec = build_spec(
        settings,
        inputs=inputs,
        model=model,
        output=output,
        job_id=job_id,
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
    if not spec.job_id:
        spec = spec.model_copy(update={"job_id": _new_job_id()})
    run(_submit(spec, settings, wait=wait, as_json=as_json))


def build_spec(
    settings: Settings,
    *,
    inputs: list[str],
    model: str,
    output: str | None,
    job_id: str | None,
    messages_file: Path | None,
    system: str | None,
    user: str | None,
    input_format: InputFormat | None,
    id_field: str | None,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    stop: list[str] | None,
    seed: int | None,
    choices: str | None,
    json_schema: Path | None,
    regex: str | None,
    output_format: OutputFormat,
    shard_size: int | None,
    max_concurrent_shards: int | None,
    spec_file: Path | None,
) -> JobSpec:
    """The JobSpec that submit's options describe (``schedule create`` takes the same);
    an invalid one exits with one clear line. The job id stays empty when neither
    ``job_id`` nor the spec file gives one."""
    values: dict[str, Any] = json.loads(spec_file.read_text()) if spec_file else {}
    values["inputs"] = inputs
    values["model"] = model
    if job_id:
        values["job_id"] = job_id
    values.setdefault("output_uri", output or f"s3://{settings.s3_bucket}/results")
    if output:
        values["output_uri"] = output
    messages = _messages(messages_file, system, user)
    if messages is not None:
        values["messages"] = messages
    options: list[tuple[str, Any]] = [
        ("input_format", input_format),
        ("id_field", id_field),
        ("shard_size", shard_size),
        ("max_concurrent_shards", max_concurrent_shards),
    ]
    for key, value in options:
        if value is not None:
            values[key] = value
    values["output_format"] = output_format
    sampling = dict(values.get("sampling") or {})
    sampling_options: list[tuple[str, Any]] = [
        ("temperature", temperature),
        ("top_p", top_p),
        ("max_tokens", max_tokens),
        ("stop", stop or None),
        ("seed", seed),
        ("regex", regex),
    ]
    for key, value in sampling_options:
        if value is not None:
            sampling[key] = value
    if choices is not None:
        sampling["choice"] = [c.strip() for c in choices.split(",") if c.strip()]
    if json_schema is not None:
        sampling["json_schema"] = json.loads(json_schema.read_text())
    values["sampling"] = sampling
    try:
        return JobSpec.model_validate(values)
    except ValidationError as exc:
        raise fail(_validation_message(exc)) from None


def _messages(
    path: Path | None, system: str | None, user: str | None
) -> list[dict[str, str]] | None:
    if path is not None:
        if system or user:
            raise fail("give either --messages or --system/--user, not both")
        try:
            loaded = json.loads(path.read_text())
            return [ChatMessage.model_validate(m).model_dump() for m in loaded]
        except (OSError, ValueError) as exc:
            raise fail(f"cannot read messages from {path}: {exc}") from None
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    if user:
        messages.append({"role": "user", "content": user})
    return messages or None


def _new_job_id() -> str:
    return f"job-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def _validation_message(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "spec"
        problems.append(f"{where}: {error['msg']}")
    return "invalid job: " + "; ".join(problems)


async def check_inputs(spec: JobSpec, settings: Settings) -> None:
    """The check the plan_job activity runs (inputs exist and are readable, the prompt's
    fields are there), here for an answer before anything is scheduled."""
    stores: dict[str, storage.ObjectStore] = {}

    def store_for(uri: str) -> storage.ObjectStore:
        scheme = storage.scheme_of(uri)
        if scheme not in stores:
            stores[scheme] = storage.open_store(uri, settings)
        return stores[scheme]

    await asyncio.to_thread(planning.inspect_inputs, spec, store_for)


async def _submit(spec: JobSpec, settings: Settings, *, wait: bool, as_json: bool) -> None:
    await check_inputs(spec, settings)
    client = await connect(settings)
    handle, started = await start_job(client, spec, settings=settings)
    if as_json and not wait:
        emit_json({"job_id": spec.job_id, "started": started, "run_id": handle.run_id})
        return
    if not as_json:
        verb = "submitted" if started else "already exists, following"
        out.print(f"job [bold]{spec.job_id}[/bold] {verb}")
        out.print(f"  web ui: {job_url(settings, spec.job_id)}")
    if wait:
        summary = await _follow(client, handle, quiet=as_json)
        _print_summary(summary, as_json=as_json)


async def _follow(
    client: Client,
    handle: WorkflowHandle[Any, JobSummary],
    *,
    quiet: bool,
    view: progress.ProgressView | None = None,
) -> JobSummary:
    """Show progress until the job ends (a bar in a terminal, lines otherwise, nothing
    when ``quiet``); return its summary. A failed or cancelled job is a CliError."""
    if view is None:
        view = progress.QuietView() if quiet else progress.choose_view(out, as_json=False)
    try:
        return await progress.follow(handle, view)
    except WorkflowFailureError as exc:
        if isinstance(exc.cause, CancelledError):
            raise CliError(f"job {handle.id} was cancelled") from exc
        raise CliError(f"job {handle.id} failed: {failure_message(exc)}") from exc


def _print_summary(summary: JobSummary, *, as_json: bool) -> None:
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
    out.print(f"  time: {summary.elapsed_s:.1f} s ({rate:.1f} items/s)")
    out.print(f"  output: {summary.output_root}/")
    out.print(f"  manifest: {summary.manifest}")


# --- status / results ---------------------------------------------------------------


def status(
    job_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show a job's state, counts, tokens and throughput."""
    run(_status(Settings(), job_id, as_json=as_json))


async def _describe(settings: Settings, job_id: str) -> tuple[str, JobProgress | JobSummary]:
    client = await connect(settings)
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
        return state, await handle.query(PROGRESS_QUERY, result_type=JobProgress)
    # Cancelled before it could say so itself, or terminated, or timed out.
    ended = (
        JobState.CANCELLED
        if description.status == WorkflowExecutionStatus.CANCELED
        else JobState.FAILED
    )
    return state, JobProgress(job_id=job_id, model="", state=ended)


async def _status(settings: Settings, job_id: str, *, as_json: bool) -> None:
    workflow_state, p = await _describe(settings, job_id)
    elapsed = _elapsed(p)
    rate = p.items_done / elapsed if elapsed else 0.0
    if as_json:
        data = p.model_dump(mode="json")
        data.update(workflow_status=workflow_state, items_per_s=rate)
        emit_json(data)
        return
    out.print(f"[bold]{job_id}[/bold]: {p.state} (workflow {workflow_state})")
    out.print(f"  model: {p.model}")
    out.print(f"  shards: {p.shards_done}/{p.shards_total} done, running {p.shards_running}")
    out.print(
        f"  items: {p.items_done}/{p.items_total} done "
        f"({p.items_succeeded} succeeded, {p.items_dead} dead)"
    )
    out.print(f"  tokens: {p.tokens.prompt} prompt, {p.tokens.completion} completion")
    out.print(f"  throughput: {rate:.1f} items/s over {elapsed:.0f} s")
    out.print(f"  web ui: {job_url(settings, job_id)}")


def _elapsed(p: JobProgress | JobSummary) -> float:
    if isinstance(p, JobSummary) and p.elapsed_s:
        return p.elapsed_s
    if p.started_at is None:
        return 0.0
    return (datetime.now(UTC) - datetime.fromisoformat(p.started_at)).total_seconds()


def results(
    job_id: Annotated[str, typer.Argument()],
    rows: Annotated[int, typer.Option("--rows", "-n", help="How many rows to show.")] = 5,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Say where a finished job's output is and show its first rows."""
    run(_results(Settings(), job_id, rows=rows, as_json=as_json))


async def _results(settings: Settings, job_id: str, *, rows: int, as_json: bool) -> None:
    state, p = await _describe(settings, job_id)
    if not isinstance(p, JobSummary):
        raise CliError(f"job {job_id} has no results yet (workflow {state})")
    store = storage.open_store(p.manifest, settings)
    manifest = json.loads(await asyncio.to_thread(store.read_bytes, p.manifest))
    first = await asyncio.to_thread(_first_rows, store, manifest["output_parts"], rows)
    if as_json:
        emit_json({"manifest": p.manifest, **manifest, "rows": first})
        return
    out.print(f"[bold]{job_id}[/bold]: {p.state}; output under {p.output_root}/")
    for part in manifest["output_parts"]:
        out.print(f"  {part}")
    for part in manifest["error_parts"]:
        out.print(f"  {part} (errors)")
    out.print(f"first {len(first)} rows:")
    for row in first:
        out.print_json(data=row)


def _first_rows(store: storage.ObjectStore, parts: list[str], limit: int) -> list[dict[str, Any]]:
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


# --- schema -------------------------------------------------------------------------


def schema() -> None:
    """Print the JSON Schema of JobSpec, for services that start jobs in other languages."""
    emit_json(JobSpec.model_json_schema())
