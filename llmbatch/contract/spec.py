"""The job spec: what a caller sends to start a batch job.

These models are the public API. They travel as Temporal workflow input (JSON), so a
service in any language can start a job with a dict matching ``llm-batch schema``.
Everything here is pure data and validation: no I/O, safe to import in workflows.

In one module on purpose: the spec and the option models nested in it are one
public schema (``llm-batch schema`` and the job-spec reference are generated from it),
read and changed together.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmbatch.contract import tables, uris
from llmbatch.contract.choices import EndpointVia, InputFormat, OutputFormat, Task
from llmbatch.contract.priority import (
    HIGHEST_PRIORITY,
    LOWEST_PRIORITY,
    MAX_TENANT_WEIGHT,
    MIN_TENANT_WEIGHT,
    TENANT_PATTERN,
)

# ":" is allowed because a Temporal Schedule names each run "<workflow id>-<RFC 3339
# UTC time>" (e.g. "nightly-2025-06-01T02:00:00Z"), and a scheduled run's job id is
# its workflow id. No "/" (shard workflows are "<job>/shard-<n>"), no spaces.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

# Endpoint names (llm-batch endpoint add): readable in task queue names, no "/".
ENDPOINT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

# Shards of a job that sets no shard_size: the first this size, each next one
# AUTO_SHARD_GROWTH times the one before, up to the largest (formats.shards.shard_rows
# works them out). Each shard costs about a quarter of a CPU-second across Temporal,
# the workers, Postgres and the object store, whatever its size: growing by 4 instead
# of 2 saves a 10,000-row job one of its four shards, while the second shard (4,000
# rows) is still read and rendered well before the engine finishes the first. An
# input's last shard joins the one before when both fit in the largest
# (formats.shards.fold_remainder): 10,000 rows are 1,000 + 9,000.
AUTO_FIRST_SHARD_ROWS = 1000
AUTO_SHARD_GROWTH = 4
AUTO_LARGEST_SHARD_ROWS = 10_000

# The names of JSON-lines inputs. Here, not in llmbatch.formats, because JobSpec's
# validation (run in workflows, which may not import I/O code) needs them too;
# format detection imports them from here, so the two never disagree.
JSONL_EXTENSIONS = (".jsonl", ".ndjson", ".json-lines", ".jsonlines")


class _Strict(BaseModel):
    # Unknown keys are refused: a misspelt option must not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Strict):
    """One chat message; ``content`` is a Jinja2 template over the row's fields."""

    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str = Field(
        min_length=1, description="A Jinja2 template over the row's fields, e.g. '{{ text }}'."
    )


# Request parameters SamplingSpec has a field for (an API line's are mapped onto them).
SAMPLING_FIELD_PARAMS = frozenset(
    {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed"}
    | {"truncate_prompt_tokens"}
)
# Body parameters that are the item's prompt or the job's, never ``SamplingSpec.params``.
NOT_SAMPLING_PARAMS = frozenset({"model", "messages", "prompt", "stream", "stream_options"})


class SamplingSpec(_Strict):
    """Sampling parameters, mapped one to one onto vLLM's ``SamplingParams``.

    At most one structured-output constraint (``choice``, ``json_schema``, ``regex``).
    """

    # Greedy by default: a re-run of a batch job gives the same answers.
    temperature: float = Field(
        default=0.0, ge=0.0, le=2.0, description="0 is greedy: the same request, the same answer."
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    max_tokens: int = Field(
        default=256, ge=1, le=131072, description="Most tokens generated for one item."
    )
    stop: list[str] | None = Field(default=None, description="Strings that end the output.")
    seed: int | None = Field(
        default=None, description="Makes sampling reproducible at a temperature above 0."
    )
    choice: list[str] | None = Field(
        default=None, min_length=1, description="The output is exactly one of these strings."
    )
    json_schema: dict[str, Any] | None = Field(
        default=None, description="The output is JSON matching this JSON Schema (parsed)."
    )
    regex: str | None = Field(default=None, description="The output matches this regex.")
    truncate_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Keep only the last N tokens of a longer prompt (vLLM's left "
        "truncation), e.g. to re-drive items whose prompt exceeded the context.",
    )
    params: dict[str, Any] | None = Field(
        default=None,
        description="Any other parameter of OpenAI's and vLLM's chat and completions "
        "requests, by its API name (n, logprobs, top_logprobs, presence_penalty, "
        "frequency_penalty, logit_bias, top_k, min_p, min_tokens, repetition_penalty, "
        "stop_token_ids, response_format, ...): the engine worker builds the sampling "
        "from vLLM's own request models, so whatever vLLM runs runs here; a name or "
        "value it refuses is that item's InvalidRequest.",
    )

    @property
    def reproducible(self) -> bool:
        """Whether the same request gives the same result again: greedy decoding or an
        explicit seed. Only such requests are deduplicated or answered from the cache."""
        return self.temperature == 0 or self.seed is not None

    @field_validator("params")
    @classmethod
    def _params_not_fields(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # A parameter with a field of its own is given once, as that field (a re-drive's
        # override and the dedup key then see it); the prompt is the item's, not sampling.
        for name in value or {}:
            if name in SAMPLING_FIELD_PARAMS or name in NOT_SAMPLING_PARAMS:
                raise ValueError(f"params.{name}: give {name!r} as its own field, not in params")
        return value or None

    @model_validator(mode="after")
    def _one_constraint(self) -> Self:
        given = [n for n in ("choice", "json_schema", "regex") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"use at most one structured-output constraint, got {given}")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from exc
        if self.choice is not None and len(set(self.choice)) != len(self.choice):
            raise ValueError("choice has duplicate entries")
        return self

    @field_validator("json_schema")
    @classmethod
    def _valid_json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _check_json_schema(value)
        return value

    def with_overrides(self, overrides: Mapping[str, Any]) -> SamplingSpec:
        """These parameters with ``overrides`` (field name to value) put over them, e.g.
        a re-drive's over a job's or a request's own. The result is validated as a
        whole, so an unknown field or a second structured-output constraint raises
        ``ValidationError``."""
        if not overrides:
            return self
        return SamplingSpec.model_validate({**self.model_dump(), **overrides})


class EmbedSpec(_Strict):
    """Options of an embed job, mapped onto vLLM's ``PoolingParams``."""

    dimensions: int | None = Field(
        default=None,
        ge=1,
        description="Keep the first N dimensions (Matryoshka models only: other models "
        "refuse it, and the item is dead-lettered as InvalidRequest).",
    )
    normalize: bool = Field(
        default=True, description="L2-normalize each vector (vLLM's pooler activation)."
    )
    truncate_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Keep only the last N tokens of a longer text, instead of dead-lettering "
        "a text longer than the model's context (PromptTooLong).",
    )

    def with_overrides(self, overrides: Mapping[str, Any]) -> EmbedSpec:
        """These options with ``overrides`` (a re-drive's ``--set
        truncate_prompt_tokens=N``, ``normalize=false``, ``dimensions=64``) put over
        them, validated as a whole: an unknown field raises ``ValidationError``."""
        if not overrides:
            return self
        return EmbedSpec.model_validate({**self.model_dump(), **overrides})


class RetrySpec(_Strict):
    """How hard llm-batch retries a shard's steps (transient failures) before the shard
    is reported failed."""

    max_activity_attempts: int = Field(
        default=10,
        ge=1,
        le=100,
        description="Attempts of each step before its shard fails and its items die as "
        "ShardFailed.",
    )


class ApiEndpoint(enum.StrEnum):
    """The request kinds an OpenAI batch may hold (one per batch, as OpenAI has it)."""

    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"

    @property
    def task(self) -> Task:
        """The task this endpoint's requests run as."""
        return Task.EMBED if self is ApiEndpoint.EMBEDDINGS else Task.GENERATE


class ApiBatch(_Strict):
    """Set on a job that is a batch of the OpenAI Batch API (``llm-batch serve``).

    Its job id is the batch id, its one input is a file uploaded through the API
    (never a location a caller named), and OpenAI's semantics apply on top of a job's:
    every line is validated before any generation (one bad line fails the whole batch,
    with its line number), the batch expires at its completion window, and its results
    end as one output file and one error file registered as API files.
    """

    # A project is also the batch's tenant (its fair share of the workers), so it is
    # named as tenants are.
    project: str = Field(pattern=TENANT_PATTERN, description="The API key's project.")
    endpoint: ApiEndpoint = Field(description="The batch's one request kind.")
    completion_window_s: int = Field(
        ge=1, description="Seconds from creation after which unfinished requests stop."
    )


class JobSpec(_Strict):
    """A batch job: input rows, a prompt, a model, and where results go."""

    job_id: Annotated[
        str,
        Field(
            default="",
            pattern=f"(?:{JOB_ID_PATTERN})|^$",
            description="The job's id, which is also its workflow id. Leave it out (or "
            "empty) to take the workflow id: each run of a Temporal Schedule is then a "
            "job of its own, named '<schedule>-<scheduled UTC time>'.",
        ),
    ]
    inputs: list[str] = Field(
        min_length=1,
        description="s3://bucket/key (globs allowed), file:///path or a plain path; or one "
        "Postgres table, postgresql://[user@]host:port/db?table=[schema.]name, or read-only "
        "query, postgresql://[user@]host:port/db?query=SELECT... (its password from the "
        "worker's environment, never the URI).",
    )
    input_format: InputFormat | None = Field(
        default=None, description="Detected from the file name when not given."
    )
    id_field: str | None = Field(
        default=None,
        description="Row field holding the item id; default custom_id for OpenAI batch "
        "input, else the row's position.",
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        description="Chat messages whose contents are Jinja2 templates over row fields. "
        "Not used for OpenAI batch input, whose request bodies are used as given.",
    )
    task: Task = Field(
        default=Task.GENERATE, description="generate text, or embed each row as a vector."
    )
    text: str | None = Field(
        default=None,
        min_length=1,
        description="Embed jobs: the text to embed, a Jinja2 template over the row's "
        "fields. Not used for OpenAI batch input (/v1/embeddings lines carry it).",
    )
    embedding: EmbedSpec | None = Field(
        default=None, description="Embed jobs' options (default: EmbedSpec())."
    )
    model: str = Field(
        min_length=1,
        description="Hugging Face model id or local path; only workers that loaded exactly "
        "this model run the job.",
    )
    remote_endpoint: str | None = Field(
        default=None,
        pattern=ENDPOINT_NAME_PATTERN,
        description="Run on a remote OpenAI-compatible endpoint declared with "
        "'llm-batch endpoint add' (served by 'llm-batch worker remote --endpoint NAME'); "
        "unset: on GPU workers that load the model.",
    )
    via: EndpointVia = Field(
        default=EndpointVia.ONLINE,
        description="With remote_endpoint: 'online' sends each request (remote workers); "
        "'batch' hands each shard to the endpoint's Batch API as one provider batch "
        "(declared with 'llm-batch endpoint add --batch-api'), waited for by the CPU workers.",
    )
    max_cost_usd: float | None = Field(
        default=None,
        gt=0,
        description="Remote endpoints: pause the job (never fail it) when what its requests "
        "cost at the endpoint's prices reaches this many USD; resume goes on past it.",
    )
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling and structured output."
    )
    shard_size: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Rows per shard: the unit of work and retry. Unset, shards grow: "
        f"the first has {AUTO_FIRST_SHARD_ROWS:,} rows, each next one {AUTO_SHARD_GROWTH} times "
        f"as many, up to {AUTO_LARGEST_SHARD_ROWS:,}, an input's last one joining the one before "
        "when both fit (the engine gets work at once, and a job pays each shard's fixed cost "
        "in Temporal, the ledger and storage seldom).",
    )
    max_concurrent_shards: int = Field(
        default=4, ge=1, le=500, description="Shards of the job that run at once."
    )
    output_uri: str = Field(
        min_length=1,
        description="Results go under <output_uri>/<job_id>/; or into a Postgres table, "
        "postgresql://[user@]host:port/db?table=[schema.]name, one row per item upserted "
        "by item id (created if absent).",
    )
    work_uri: str | None = Field(
        default=None,
        description="Jobs whose output is a table: where the job keeps its plans, staging, "
        "error parts and manifest (default s3://<the workers' bucket>/tables).",
    )
    output_format: OutputFormat = Field(
        default=OutputFormat.JSONL, description="How the output parts are written."
    )
    output_fields: list[str] | None = Field(
        default=None, description="Input fields copied to each output row; default all."
    )
    max_row_bytes: int = Field(
        default=1 << 20, ge=1, le=64 << 20, description="Larger rows die as RowTooLarge."
    )
    retry: RetrySpec = Field(default_factory=RetrySpec, description="Retries of a shard's steps.")
    dedup: bool = Field(
        default=True,
        description="Generate each distinct request of the job once and share its result "
        "with the items that repeat it (only for greedy or seeded sampling).",
    )
    cache: bool | None = Field(
        default=None,
        description="Answer requests from results of earlier jobs for the same request and "
        "model weights (only for greedy or seeded sampling); unset: the GPU workers' "
        "LLMBATCH_CACHE setting.",
    )
    api_batch: ApiBatch | None = Field(
        default=None, description="Set by `llm-batch serve` for an OpenAI Batch API batch."
    )
    # Where the job stands in the task queues (llmbatch.contract.priority): set on its
    # workflow, its shards and every activity, so its GPU steps wait behind higher
    # priorities and share the workers fairly with other tenants' jobs.
    priority: int | None = Field(
        default=None,
        ge=HIGHEST_PRIORITY,
        le=LOWEST_PRIORITY,
        description=f"Task-queue priority, {HIGHEST_PRIORITY} (first) to {LOWEST_PRIORITY} "
        "(last); Temporal's default (3) when left out. Backlogged tasks of a higher "
        "priority run before any of a lower one.",
    )
    tenant: str | None = Field(
        default=None,
        pattern=TENANT_PATTERN,
        description="The team or project the job runs for (Temporal's fairness key): "
        "jobs of different tenants at one priority share the workers in proportion to "
        "their weights. Up to 64 characters: letters, digits, '.', '_', ':', '@', '/', '-'.",
    )
    tenant_weight: float | None = Field(
        default=None,
        ge=MIN_TENANT_WEIGHT,
        le=MAX_TENANT_WEIGHT,
        description="The tenant's share relative to other tenants (default 1); needs tenant.",
    )

    @field_validator("job_id", mode="before")
    @classmethod
    def _null_job_id(cls, value: Any) -> Any:
        # JSON null from another language's client means "not given", as "" does.
        return "" if value is None else value

    @field_validator("inputs")
    @classmethod
    def _no_blank_inputs(cls, value: list[str]) -> list[str]:
        if any(not v.strip() for v in value):
            raise ValueError("an input URI is empty")
        if any(tables.is_table_uri(v) for v in value):
            if len(value) > 1:
                raise ValueError("a table or query input is a job's only input")
            tables.parse_table_uri(value[0])  # its TableUriError is a ValueError
            return value
        for uri in value:
            _no_parent_segment(uri, "input")
        return value

    @field_validator("output_uri")
    @classmethod
    def _output_where_results_may_go(cls, value: str) -> str:
        # Refused here, before any work: an unknown scheme would otherwise fail only
        # when the first shard writes, and a ".." could write outside the folder.
        if tables.is_table_uri(value):
            tables.parse_table_uri(value, output=True)
            return value
        scheme = uris.scheme_of(value)
        if scheme not in uris.SUPPORTED_SCHEMES:
            raise ValueError(
                f"output URI {value!r} has unsupported scheme {scheme!r}; "
                "use s3://bucket/prefix, file:///abs/path or a path"
            )
        _no_parent_segment(value, "output")
        return value

    @model_validator(mode="after")
    def _table_input(self) -> Self:
        table_input = tables.is_table_uri(self.inputs[0])
        if table_input and self.input_format not in (None, InputFormat.TABLE):
            raise ValueError("a table or query input is read as a table; drop 'input_format'")
        if not table_input and self.input_format is InputFormat.TABLE:
            raise ValueError("input_format 'table' needs a postgresql:// input")
        if table_input and self.id_field is None:
            if tables.parse_table_uri(self.inputs[0]).query is not None:
                raise ValueError(
                    "a query input needs id_field: the unique key column its shards are cut by"
                )
        if self.work_uri is not None:
            if uris.scheme_of(self.work_uri) not in uris.SUPPORTED_SCHEMES:
                raise ValueError("work_uri must be s3://bucket/prefix, file:///abs/path or a path")
            _no_parent_segment(self.work_uri, "work")
        return self

    @property
    def table_input(self) -> bool:
        """Whether the job reads a Postgres table or query."""
        return tables.is_table_uri(self.inputs[0])

    @property
    def table_output(self) -> bool:
        """Whether the job upserts its results into a Postgres table."""
        return tables.is_table_uri(self.output_uri)

    @property
    def embed_options(self) -> EmbedSpec:
        """The embed options in force (the defaults when none were given)."""
        return self.embedding or EmbedSpec()

    def options_with(self, overrides: Mapping[str, Any]) -> SamplingSpec | EmbedSpec:
        """The options of the job's task (sampling, or an embed job's embed options)
        with a re-drive's ``overrides`` over them; an option the task does not have
        raises ``ValidationError``."""
        if self.task is Task.EMBED:
            return self.embed_options.with_overrides(overrides)
        return self.sampling.with_overrides(overrides)

    @property
    def endpoint(self) -> ApiEndpoint:
        """Where the job's OpenAI batch lines must point: an API batch's own endpoint,
        else its task's (chat completions, or embeddings)."""
        if self.api_batch is not None:
            return self.api_batch.endpoint
        return ApiEndpoint.EMBEDDINGS if self.task is Task.EMBED else ApiEndpoint.CHAT_COMPLETIONS

    def template_messages(self) -> list[ChatMessage] | None:
        """The templates rendered over each row: the prompt messages of a generate job,
        or an embed job's text as one message (so both render in the same sandbox)."""
        if self.task is Task.EMBED:
            return None if self.text is None else [ChatMessage(role="user", content=self.text)]
        return self.messages

    @model_validator(mode="after")
    def _task_options(self) -> Self:
        # Each refusal names the field, so the caller knows what to drop.
        if self.task is Task.EMBED:
            if self.messages is not None:
                raise ValueError("an embed job takes 'text', not 'messages'")
            if self.sampling != SamplingSpec():
                raise ValueError("'sampling' options are for generate jobs; drop them")
            if self.input_format is InputFormat.OPENAI and self.text is not None:
                raise ValueError("OpenAI batch input carries its own input; drop 'text'")
            if self.input_format is not InputFormat.OPENAI and self.text is None:
                if not all(_looks_like_jsonl(u) for u in self.inputs):
                    raise ValueError(
                        "'text' is required for an embed job unless the input is OpenAI batch JSONL"
                    )
        else:
            if self.text is not None:
                raise ValueError("'text' is for embed jobs (task 'embed'); use 'messages'")
            if self.embedding is not None:
                raise ValueError("'embedding' options are for embed jobs (task 'embed')")
        return self

    @model_validator(mode="after")
    def _prompt_given(self) -> Self:
        if self.task is Task.EMBED:
            return self
        if self.input_format is not InputFormat.OPENAI and self.messages is None:
            # The format may still be detected as OpenAI later; planning checks again.
            if not all(_looks_like_jsonl(u) for u in self.inputs):
                raise ValueError("messages are required unless the input is OpenAI batch JSONL")
        if self.input_format is InputFormat.OPENAI and self.messages is not None:
            raise ValueError("OpenAI batch input carries its own messages; drop 'messages'")
        return self

    @model_validator(mode="after")
    def _endpoint_fits_task(self) -> Self:
        if self.api_batch is not None and self.api_batch.endpoint.task is not self.task:
            raise ValueError(
                f"an API batch for {self.api_batch.endpoint} is a {self.api_batch.endpoint.task} "
                f"job; set task to {self.api_batch.endpoint.task!r}"
            )
        return self

    @model_validator(mode="after")
    def _batch_needs_endpoint(self) -> Self:
        if self.via is EndpointVia.BATCH and self.remote_endpoint is None:
            raise ValueError("via 'batch' needs a remote_endpoint (its provider's Batch API)")
        if self.via is EndpointVia.BATCH and self.task is not Task.GENERATE:
            raise ValueError("via 'batch' runs generate jobs only")
        return self

    @model_validator(mode="after")
    def _weight_has_tenant(self) -> Self:
        # A weight belongs to a fairness key: without one it would weigh the shared
        # default key of every job that names no tenant.
        if self.tenant_weight is not None and self.tenant is None:
            raise ValueError("tenant_weight needs a tenant")
        return self


def _no_parent_segment(uri: str, what: str) -> None:
    if uris.has_parent_segment(uri):
        raise ValueError(f"{what} URI {uri!r} has a '..' segment; name the folder directly")


def _check_json_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not a JSON Schema now, in one line, rather than let every
    item of the job die on it in the engine's structured-output backend."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(
            f"json_schema is not a valid JSON Schema: {exc.message}"
            + (f" (at {where})" if where else "")
        ) from None


def _looks_like_jsonl(uri: str) -> bool:
    # A glob ending in "*" may match OpenAI batch JSONL too: planning decides.
    return uri.lower().endswith((*JSONL_EXTENSIONS, "*"))
