"""The job options, declared once for every command that starts jobs.

``submit`` and ``schedule create`` take the same ~20 options. Each is declared here,
once, as a field of :class:`JobOptions`; :func:`job_options` gives a command all of
them in place of its ``job: JobOptions`` parameter, and :meth:`JobOptions.to_spec`
is the one place their values become a :class:`JobSpec`. A new option is one new
field here (and a line in ``to_spec``), and both commands have it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from llmbatch.cli._support.common import CliError, fail
from llmbatch.contract import uris
from llmbatch.contract.choices import (
    DEFAULT_PRIORITY,
    HIGHEST_PRIORITY,
    LOWEST_PRIORITY,
    EndpointVia,
    InputFormat,
    OutputFormat,
    Task,
)

if TYPE_CHECKING:
    # The commands' signatures are built from JobOptions whenever the CLI starts: the
    # spec's models, pydantic and the storage code load when a job is made.
    from pydantic import ValidationError

    from llmbatch.config import Settings
    from llmbatch.contract.spec import JobSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobOptions:
    """The values of the job options; the field annotations are the CLI declarations."""

    inputs: Annotated[
        list[str],
        typer.Option(
            "--input",
            "-i",
            help="Input URI or path; repeat. Or one Postgres table or read-only query: "
            "'postgresql://HOST:PORT/DB?table=NAME' or '...?query=SELECT ...' (with "
            "--id-field; the password from the worker's PGPASSWORD or pgpass file).",
        ),
    ]
    model: Annotated[str, typer.Option(help="Hugging Face model id or local path.")]
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="Run on this remote endpoint (llm-batch endpoint add); --model is then the "
            "name the endpoint serves it under. Default: the endpoint the model is routed to "
            "(endpoint add/update --serve-as), if any."
        ),
    ] = None
    via: Annotated[
        EndpointVia | None,
        typer.Option(
            help="With --endpoint: 'batch' hands each shard to the endpoint's Batch API "
            "(endpoint add --batch-api) at its batch prices; 'online' (default) sends requests."
        ),
    ] = None
    max_cost: Annotated[
        float | None,
        typer.Option(
            help="With --endpoint: pause the job when its cost at the endpoint's prices "
            "reaches this many USD."
        ),
    ] = None
    output: Annotated[
        str | None,
        typer.Option(
            help="Output URI; default s3://<bucket>/results. Or a Postgres table, "
            "'postgresql://HOST:PORT/DB?table=NAME': one row per item, upserted by item id."
        ),
    ] = None
    messages_file: Annotated[
        Path | None, typer.Option("--messages", help="JSON file: [{role, content}, ...].")
    ] = None
    system: Annotated[str | None, typer.Option(help="System message template.")] = None
    user: Annotated[str | None, typer.Option(help="User message template, e.g. '{{ text }}'.")] = (
        None
    )
    task: Annotated[
        Task | None, typer.Option(help="generate (the default) or embed: one vector per row.")
    ] = None
    text: Annotated[
        str | None,
        typer.Option(help="Embed jobs: the text to embed, e.g. '{{ title }}\\n{{ body }}'."),
    ] = None
    dimensions: Annotated[
        int | None, typer.Option(help="Embed jobs: keep N dimensions (Matryoshka models).")
    ] = None
    normalize: Annotated[
        bool | None, typer.Option("--normalize/--no-normalize", help="Embed jobs: L2-normalize.")
    ] = None
    truncate_prompt_tokens: Annotated[
        int | None,
        typer.Option(help="Keep the last N tokens of a longer prompt or text, not dead-letter it."),
    ] = None
    input_format: Annotated[
        InputFormat | None,
        typer.Option("--format", help="Input format; default: from the file names."),
    ] = None
    id_field: Annotated[
        str | None,
        typer.Option(
            help="Row field with the item id (a table's key column; default its primary key)."
        ),
    ] = None
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature; default 0 (greedy, reproducible).")
    ] = None
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling; default 1.")] = None
    max_tokens: Annotated[
        int | None, typer.Option(help="Most tokens generated per item; default 256.")
    ] = None
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeat.")] = None
    seed: Annotated[
        int | None,
        typer.Option(help="Sampling seed: makes sampling at temperature > 0 reproducible."),
    ] = None
    choices: Annotated[str | None, typer.Option(help="Comma-separated allowed answers.")] = None
    json_schema: Annotated[
        Path | None, typer.Option(help="JSON Schema file the output must match.")
    ] = None
    regex: Annotated[str | None, typer.Option(help="Regex the output must match.")] = None
    output_format: Annotated[OutputFormat, typer.Option(help="Format of the output parts.")] = (
        OutputFormat.JSONL
    )
    shard_size: Annotated[int | None, typer.Option(help="Rows per shard.")] = None
    max_concurrent_shards: Annotated[
        int | None, typer.Option(help="Shards of the job that run at once; default 4.")
    ] = None
    dedup: Annotated[
        bool | None,
        typer.Option(
            "--dedup/--no-dedup",
            help="Generate each distinct request once (greedy or seeded sampling); on by default.",
        ),
    ] = None
    cache: Annotated[
        bool | None,
        typer.Option(
            "--cache/--no-cache",
            help="Answer requests from earlier jobs' results for the same model weights "
            "(greedy or seeded sampling); default: the GPU workers' LLMBATCH_CACHE.",
        ),
    ] = None
    priority: Annotated[
        int | None,
        typer.Option(
            help=f"{HIGHEST_PRIORITY} (runs first) to {LOWEST_PRIORITY} (last); default "
            f"{DEFAULT_PRIORITY}. Its shards wait behind higher priorities' on the GPU workers."
        ),
    ] = None
    tenant: Annotated[
        str | None,
        typer.Option(help="Team or project: tenants share the GPU workers fairly."),
    ] = None
    tenant_weight: Annotated[
        float | None, typer.Option(help="The tenant's share against others' (default 1).")
    ] = None
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A whole JobSpec as JSON; options override it.")
    ] = None

    def to_spec(self, settings: Settings, *, job_id: str | None = None) -> JobSpec:
        """The JobSpec these options describe; an invalid one exits with one clear line.

        The job id is ``job_id``, else the spec file's; it stays empty when neither
        gives one (submit then names the job, a schedule names each run).
        """
        from pydantic import ValidationError

        from llmbatch.contract.spec import JobSpec

        values: dict[str, Any] = {}
        if self.spec_file is not None:
            values = _read_json(self.spec_file, "--spec")
            if not isinstance(values, dict):
                raise fail(f"--spec {self.spec_file}: a JobSpec is a JSON object")
        values["inputs"] = self.inputs
        values["model"] = self.model
        if job_id:
            values["job_id"] = job_id
        values.setdefault("output_uri", self.output or f"s3://{settings.s3_bucket}/results")
        if self.output:
            values["output_uri"] = self.output
        messages = _messages(self.messages_file, self.system, self.user)
        if messages is not None:
            values["messages"] = messages
        options: list[tuple[str, Any]] = [
            ("input_format", self.input_format),
            ("id_field", self.id_field),
            ("shard_size", self.shard_size),
            ("max_concurrent_shards", self.max_concurrent_shards),
            ("dedup", self.dedup),
            ("cache", self.cache),
            ("priority", self.priority),
            ("tenant", self.tenant),
            ("tenant_weight", self.tenant_weight),
            ("remote_endpoint", self.endpoint),
            ("via", self.via),
            ("max_cost_usd", self.max_cost),
        ]
        for key, value in options:
            if value is not None:
                values[key] = value
        values["output_format"] = self.output_format
        sampling = dict(values.get("sampling") or {})
        sampling_options: list[tuple[str, Any]] = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("max_tokens", self.max_tokens),
            ("stop", self.stop or None),
            ("seed", self.seed),
            ("regex", self.regex),
        ]
        for key, value in sampling_options:
            if value is not None:
                sampling[key] = value
        if self.choices is not None:
            sampling["choice"] = [c.strip() for c in self.choices.split(",") if c.strip()]
        if self.json_schema is not None:
            sampling["json_schema"] = _read_json(self.json_schema, "--json-schema")
        values["sampling"] = sampling
        if self.task is not None:
            values["task"] = self.task
        if self.text is not None:
            values["text"] = self.text
        self._task_options(values)
        # A worker resolves a relative path against its own working directory, not
        # this one: send absolute paths.
        values["inputs"] = [_absolute(uri) for uri in values["inputs"]]
        if isinstance(values["output_uri"], str):
            values["output_uri"] = _absolute(values["output_uri"])
        try:
            return JobSpec.model_validate(values)
        except ValidationError as exc:
            raise fail(_validation_message(exc)) from None

    def _task_options(self, values: dict[str, Any]) -> None:
        """Put the embed options in ``values["embedding"]`` and truncation where the
        job's task takes it; JobSpec refuses what does not fit the task, by name."""
        embedding = dict(values.get("embedding") or {})
        for key, value in (("dimensions", self.dimensions), ("normalize", self.normalize)):
            if value is not None:
                embedding[key] = value
        embed = values.get("task") == Task.EMBED
        if self.truncate_prompt_tokens is not None:
            target = embedding if embed else values["sampling"]
            target["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        if embedding:
            values["embedding"] = embedding


def job_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give a command every job option in place of its ``job: JobOptions`` parameter.

    Typer builds a command's options from its signature, so the returned function
    presents one: the command's own parameters, with :class:`JobOptions`' fields
    (annotations and defaults) standing where ``job`` stood. When called, it collects
    those values into a ``JobOptions`` and calls ``command`` with it.
    """
    signature = inspect.signature(command, eval_str=True)
    if "job" not in signature.parameters:
        raise TypeError(f"{command.__name__} has no 'job: JobOptions' parameter")
    fields = dataclasses.fields(JobOptions)
    clash = {f.name for f in fields} & set(signature.parameters)
    if clash:
        raise TypeError(f"{command.__name__}: parameters clash with job options: {clash}")
    hints = get_type_hints(JobOptions, include_extras=True)
    job_params = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            annotation=hints[f.name],
        )
        for f in fields
    ]
    params: list[inspect.Parameter] = []
    for param in signature.parameters.values():
        # Keyword-only: Typer passes everything by name, and it frees the order of
        # parameters with and without defaults.
        if param.name == "job":
            params.extend(job_params)
        else:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(command)
    def with_job_options(**values: Any) -> None:
        job = JobOptions(**{f.name: values.pop(f.name) for f in fields})
        command(job=job, **values)

    # What Typer reads: inspect.signature() honours __signature__, and
    # typing.get_type_hints() reads __annotations__ (already evaluated here).
    with_job_options.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    with_job_options.__annotations__ = {p.name: p.annotation for p in params} | {
        "return": signature.return_annotation
    }
    return with_job_options


def _messages(
    path: Path | None, system: str | None, user: str | None
) -> list[dict[str, str]] | None:
    from pydantic import ValidationError

    from llmbatch.contract.spec import ChatMessage

    if path is not None:
        if system or user:
            raise fail("give either --messages or --system/--user, not both")
        loaded = _read_json(path, "--messages")
        if not isinstance(loaded, list):
            raise fail(f"--messages {path}: expected a JSON list of {{role, content}}")
        try:
            return [ChatMessage.model_validate(m).model_dump() for m in loaded]
        except ValidationError as exc:
            raise fail(
                f"--messages {path}: {_validation_message(exc, 'invalid messages')}"
            ) from None
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    if user:
        messages.append({"role": "user", "content": user})
    return messages or None


def _absolute(uri: str) -> str:
    """``uri`` itself, or for a plain path that is relative (or starts with ``~``) the
    absolute path. ``..`` stays as given, for the spec's validation to refuse."""
    if uris.split_scheme(uri)[0] is not None or not uri.strip() or uri.startswith("/"):
        return uri
    return str(Path(uri).expanduser().absolute())


def _read_json(path: Path, option: str) -> Any:
    """The JSON document in the file an option names; a missing, unreadable or broken
    file exits with one line naming the option and the file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(f"{option} {path}: no such file") from None
    except OSError as exc:
        raise fail(f"{option} {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise fail(f"{option} {path}: not a text file") from None
    except json.JSONDecodeError as exc:
        raise fail(
            f"{option} {path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None


def _validation_message(exc: ValidationError, prefix: str = "invalid job") -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "spec"
        problems.append(f"{where}: {error['msg']}")
    return f"{prefix}: " + "; ".join(problems)


async def check_inputs(spec: JobSpec, settings: Settings) -> None:
    """The check the plan_job activity runs (inputs exist and are readable, the prompt's
    fields are there, it renders the first row), here for an answer before anything is
    scheduled."""
    import asyncio

    from llmbatch import storage
    from llmbatch.formats import planning
    from llmbatch.tables import jobs as tables

    try:
        if not spec.table_input:
            await asyncio.to_thread(
                planning.inspect_inputs,
                spec,
                storage.stores.Stores(settings),
                settings.render_limits,
            )
        if spec.table_input or spec.table_output:
            await tables.check_table_job(
                spec, settings, settings.render_limits, create_output=False
            )
    except planning.InvalidJobSpec as exc:
        raise CliError(str(exc)) from None


async def place_job(spec: JobSpec, settings: Settings) -> JobSpec:
    """The spec with its engine settled, for ``submit`` and ``schedule create`` alike
    (:func:`llmbatch.provider.placement.place`, which the OpenAI Batch API uses too)."""
    from llmbatch import ledger
    from llmbatch.provider.placement import place
    from llmbatch.remote.endpoints import EndpointError

    try:
        pool = await ledger.db.create_pool(
            settings.postgres_dsn.get_secret_value(), max_size=1, connect_timeout_s=10.0
        )
    except (OSError, TimeoutError) as exc:
        raise CliError(f"cannot reach Postgres (it holds the endpoints): {exc}") from None
    try:
        return await place(pool, spec)
    except EndpointError as exc:
        raise CliError(str(exc)) from None
    finally:
        await pool.close()
