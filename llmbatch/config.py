"""One settings model for every process: CLI, workers, the embedded stack.

Values come from, highest first: keyword arguments, ``LLMBATCH_*`` environment
variables, a TOML file (``LLMBATCH_CONFIG`` or ``./llm-batch.toml``), defaults.
The defaults point at the embedded stack, so a real deployment changes only
settings, never code.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from llmbatch.contract.names import MODEL_HASH_CHARS, model_identity, model_slug
from llmbatch.contract.priority import ANY_TENANT, TenantQuota
from llmbatch.contract.spec import Task
from llmbatch.remote.faults import FaultPolicy
from llmbatch.rendering.limits import RenderLimits

CONFIG_ENV_VAR = "LLMBATCH_CONFIG"
DEFAULT_CONFIG_FILE = "llm-batch.toml"
REDACTED = "***"
# Query parameters that carry a credential in a DSN (libpq's password, sslpassword).
_SECRET_PARAMS = ("password", "secret", "token")


def _config_file() -> Path | None:
    explicit = os.environ.get(CONFIG_ENV_VAR)
    if explicit:
        return Path(explicit)
    local = Path(DEFAULT_CONFIG_FILE)
    return local if local.is_file() else None


class Settings(BaseSettings):
    """Where llm-batch finds Temporal, Postgres and the object store."""

    model_config = SettingsConfigDict(
        env_prefix="LLMBATCH_",
        extra="ignore",
        validate_default=True,
    )

    state_dir: Path = Field(
        default=Path(".llm-batch"),
        description="Folder for the embedded stack's data, logs and pid files.",
    )

    temporal_address: str = Field(
        default="127.0.0.1:7233",
        description="Temporal's frontend (host:port). Set, it wins over TEMPORAL_ADDRESS and "
        "Temporal's config profile; TLS and API keys come from Temporal's own TEMPORAL_* settings.",
    )
    temporal_namespace: str = Field(
        default="llm-batch",
        description="The Temporal namespace jobs run in (wins over TEMPORAL_NAMESPACE when set).",
    )
    temporal_ui_port: int = Field(
        default=8233, description="Port of the embedded stack's Temporal Web UI."
    )
    cpu_task_queue: str = Field(
        default="llm-batch-cpu",
        description="Task queue of the CPU workers: the workflows and the CPU activities. "
        "Clients start BatchJobWorkflow on it.",
    )
    gpu_task_queue_prefix: str = Field(
        default="llm-batch-gpu",
        description="GPU queues are named '<prefix>-<task>-<model slug>-<model hash>', so a "
        "worker only takes work for the task and the exact model it serves.",
    )
    generate_schedule_to_start: timedelta = Field(
        default=timedelta(hours=1),
        gt=timedelta(0),
        description="How long a shard's generate step waits for a worker serving the job's "
        "model before its items die as NoWorker (seconds or an ISO 8601 duration).",
    )

    priority_aging: timedelta = Field(
        default=timedelta(minutes=10),
        ge=timedelta(0),
        description="Bounded wait: a shard's generate step that waits this long for a GPU "
        "worker is queued again one priority level higher (5 → 4 … → 1), so a steady "
        "stream of urgent work cannot starve a low-priority job; at most four such steps "
        "lift any job to priority 1 (seconds or an ISO 8601 duration; 0: no aging). Read by "
        "the CPU worker that plans a job.",
    )
    progress_every: timedelta = Field(
        default=timedelta(seconds=30),
        ge=timedelta(0),
        description="How often a running job's search attributes (ItemsDone, ItemsDead) and "
        "Web UI details line take what its running shards have recorded in the ledger, one "
        "small query a job per interval (seconds or an ISO 8601 duration; 0: only when a "
        "shard ends). `status` and `watch` read the ledger themselves, every poll. Read by "
        "the CPU worker that plans a job.",
    )
    tenant_quotas: dict[str, TenantQuota] = Field(
        default_factory=dict,
        description="What each tenant (an API project, or a CLI job's --tenant) may ask "
        'for, as JSON or a TOML table: {"team-a": {"highest_priority": 2, "max_weight": 4, '
        '"max_concurrent_jobs": 3}}; the key "*" caps every tenant not listed (and jobs '
        "without a tenant). `submit` and `POST /v1/batches` refuse a job beyond its cap.",
    )

    cache: bool = Field(
        default=False,
        description="Answer reproducible requests (greedy or seeded) of jobs that do not say "
        "(JobSpec.cache unset) from earlier jobs' results for the same model weights. Read by "
        "GPU and remote workers, which record it with their queue for the prepare step; "
        "`submit --cache/--no-cache` decides per job.",
    )
    cache_shared_across_tenants: bool = Field(
        default=False,
        description="Let the result cache answer a job from another tenant's results (an "
        "API project is its batches' tenant). Off: each tenant's results answer its own "
        "jobs only, so no tenant gets, or can time, another's. Read by GPU and remote workers "
        "(recorded with their queue for the prepare step).",
    )
    drain_timeout: timedelta = Field(
        default=timedelta(seconds=25),
        ge=timedelta(0),
        description="How long a stopping worker (SIGTERM, SIGINT) lets work in flight "
        "finish before it hands the rest back (Temporal's graceful shutdown timeout; "
        "seconds or an ISO 8601 duration). Fits a GKE spot notice; keep the pod's "
        "terminationGracePeriodSeconds longer. 0: hand back at once.",
    )
    ready_file: Path | None = Field(
        default=None,
        description="A file a GPU worker writes once its engine is loaded and it polls, "
        "and removes when it stops (a Kubernetes readiness probe tests for it).",
    )
    gpu_hour_price: float | None = Field(
        default=None,
        ge=0,
        description="Price of one GPU for an hour on this GPU worker (an engine on several "
        "GPUs counts each); jobs then report their cost. Unset: no cost shown.",
    )

    # Remote endpoints (llmbatch.remote.faults): what an endpoint may cost a job before
    # llm-batch stops waiting on it. Read by remote workers.
    remote_max_retry_after_s: float = Field(
        default=300.0,
        gt=0,
        description="Longest wait in seconds a remote endpoint's 429/503 may impose (its "
        "Retry-After, retry-after-ms or rate-limit reset); a longer ask is cut to this, and "
        "`status` says so. `llm-batch endpoint update NAME` or `resume` of a job lifts a "
        "wait at once. Read by remote workers.",
    )
    remote_max_unusable_answers: int = Field(
        default=20,
        ge=1,
        description="Unusable answers in a row (a 2xx whose body is not JSON or not an "
        "answer, such as an HTML page) a job may get from an endpoint on one remote worker "
        "before the job is paused; each may be paid for. Read by remote workers.",
    )
    remote_pause_after_failing_s: float = Field(
        default=300.0,
        ge=0,
        description="Seconds a job's requests to an endpoint may all go unanswered "
        "(connection refused, unknown host, timeouts, dropped connections, 5xx) before the "
        "job is paused with the last error (0: never; they are sent again until the "
        "endpoint answers). Read by remote workers.",
    )

    # Payload encryption (llmbatch.security.codec): a keyring as JSON, or a file of it;
    # neither set, the state folder's codec-keys.json (`llm-batch dev up --encrypt`).
    codec_keys: SecretStr | None = Field(
        default=None,
        description='The payload-encryption keyring as JSON: {"current": ID, "keys": '
        "{ID: base64 of 32 bytes}}. Set, every payload llm-batch puts in Temporal is "
        "encrypted with the current key.",
    )
    codec_keys_file: Path | None = Field(
        default=None, description="A file holding the keyring (see codec_keys)."
    )
    codec_server_api_key: SecretStr | None = Field(
        default=None,
        description="The key `llm-batch codec-server` asks of every request "
        "(Authorization: Bearer KEY).",
    )
    codec_server_port: int = Field(
        default=8234, description="The embedded stack's codec server port (dev up --encrypt)."
    )

    postgres_dsn: SecretStr = Field(
        default=SecretStr("postgresql://postgres@127.0.0.1:55432/llmbatch"),
        description="The item ledger's Postgres (a libpq URI); never printed with its password.",
    )
    migrations_dir: Path | None = Field(
        default=None,
        description="A folder of NNNN_name.sql files to apply instead of the migrations "
        "shipped with llm-batch (unset: the shipped ones, wherever it is installed).",
    )

    s3_endpoint_url: str | None = Field(
        default="http://127.0.0.1:8333",
        description="The S3-compatible object store's endpoint (the embedded SeaweedFS by "
        "default).",
    )
    s3_region: str = Field(default="us-east-1", description="The object store's region.")
    s3_access_key_id: SecretStr = Field(
        default=SecretStr("llmbatch"), description="The object store's access key id."
    )
    s3_secret_access_key: SecretStr = Field(
        default=SecretStr("llmbatch-secret"), description="The object store's secret key."
    )
    s3_bucket: str = Field(
        default="llm-batch",
        description="The bucket for staging and the API's files; the embedded stack creates "
        "it, a job's own output bucket must exist.",
    )

    local_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path.cwd()],
        description="Folders (os.pathsep-separated) under which local paths and file:// "
        "URIs may be read and written; '/' allows all. Default: the working directory.",
    )

    @field_validator("local_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        # An environment variable holds them as a PATH-style list, not JSON.
        if isinstance(value, str):
            value = [part for part in value.split(os.pathsep) if part.strip()]
        if isinstance(value, list | tuple) and not value:
            raise ValueError("name at least one folder ('/' allows all)")
        return value

    @field_validator("local_roots")
    @classmethod
    def _absolute_roots(cls, value: list[Path]) -> list[Path]:
        # Fixed now: a relative root must not move with a later chdir.
        return [p.expanduser().absolute() for p in value]

    allowed_tables: str = Field(
        default="",
        description="Comma-separated globs over host:port/database/schema.table naming "
        "the Postgres tables jobs may read and write, e.g. 'db.internal:5432/app/public.*'; "
        "a query input needs its whole database ('host:port/db/*'). Empty: none.",
    )

    @property
    def allowed_table_patterns(self) -> list[str]:
        """``allowed_tables`` as a list of globs."""
        return [p.strip() for p in self.allowed_tables.split(",") if p.strip()]

    # Prompt templates are caller input: a row's render is bounded (llmbatch.rendering.pool).
    render_timeout_s: float = Field(
        default=5.0, gt=0, description="Wall-clock limit for rendering one row's prompt."
    )
    render_max_bytes: int = Field(
        default=4 << 20, gt=0, description="Largest rendered prompt (all messages) of a row."
    )
    render_max_memory_mb: int = Field(
        default=1024, gt=0, description="Memory a render process may take beyond its start."
    )

    # The OpenAI Batch API (`llm-batch serve`): validation refuses a larger batch file.
    api_max_requests_per_batch: int = Field(
        default=50_000, ge=1, description="Most requests one batch file may hold (OpenAI's)."
    )
    api_port: int = Field(
        default=8000,
        description="Port of `llm-batch serve` (its --port), and the one `dev up` and the "
        "demo name in the API's base URL.",
    )
    api_max_file_bytes: int = Field(
        default=200 << 20,
        gt=0,
        description="Largest file `POST /v1/files` accepts (OpenAI's batch input limit, 200 MB).",
    )
    api_max_batches_in_progress: int = Field(
        default=100,
        gt=0,
        description="Batches of one project that may be unfinished at once; one more answers 429.",
    )
    api_shard_size: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Requests per shard of an API batch (a job's shard_size). Unset: "
        "shards grow from 1,000 requests to 10,000, as a job's do.",
    )
    api_max_concurrent_shards: int = Field(
        default=4,
        ge=1,
        le=500,
        description="Shards of one API batch that run at once (a job's max_concurrent_shards).",
    )
    api_stale_upload_after: timedelta = Field(
        default=timedelta(hours=6),
        gt=timedelta(0),
        description="An S3 multipart upload of `POST /v1/files` still open this long after "
        "it began is aborted by `llm-batch serve` (a server killed mid-upload leaves one "
        "that nothing completes); seconds or an ISO 8601 duration.",
    )
    api_upload_part_bytes: int = Field(
        default=8 << 20,
        ge=5 << 20,
        description="An upload streams to the object store in parts of this size (S3's "
        "smallest is 5 MiB); the server holds about one part per upload in memory.",
    )

    def quota(self, tenant: str | None) -> TenantQuota:
        """The caps of ``tenant`` (its own entry, else the "*" one, else none)."""
        named = self.tenant_quotas.get(tenant) if tenant is not None else None
        return named or self.tenant_quotas.get(ANY_TENANT) or TenantQuota()

    @property
    def remote_fault_policy(self) -> FaultPolicy:
        return FaultPolicy(
            max_retry_after_s=self.remote_max_retry_after_s,
            max_unusable_answers=self.remote_max_unusable_answers,
            pause_after_failing_s=self.remote_pause_after_failing_s,
        )

    @property
    def render_limits(self) -> RenderLimits:
        return RenderLimits(
            timeout_s=self.render_timeout_s,
            max_bytes=self.render_max_bytes,
            max_memory_bytes=self.render_max_memory_mb << 20,
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file()
        if path is not None:
            if not path.is_file():
                raise FileNotFoundError(
                    f"config file {path} (from ${CONFIG_ENV_VAR}) does not exist"
                )
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @property
    def web_ui_url(self) -> str:
        host = self.temporal_address.rsplit(":", 1)[0]
        return f"http://{host}:{self.temporal_ui_port}"

    @property
    def temporal_port(self) -> int:
        return int(self.temporal_address.rsplit(":", 1)[1])

    @property
    def postgres_port(self) -> int:
        return urlsplit(self.postgres_dsn.get_secret_value()).port or 5432

    @property
    def postgres_database(self) -> str:
        return urlsplit(self.postgres_dsn.get_secret_value()).path.lstrip("/") or "postgres"

    @property
    def s3_port(self) -> int:
        if self.s3_endpoint_url is None:
            raise ValueError("s3_endpoint_url is not set")
        return urlsplit(self.s3_endpoint_url).port or 80

    def gpu_task_queue(
        self, model: str, task: Task = Task.GENERATE, *, endpoint: str | None = None
    ) -> str:
        """The task queue of workers that serve ``task`` with exactly ``model`` loaded,
        or with ``endpoint`` given, of the remote workers that call that endpoint's
        ``model`` (``llm-batch worker remote``).

        The plan of a job, the GPU and remote workers and the CLI's poller check all
        call this, so they cannot disagree on a name.
        """
        identity = model_identity(model)
        if endpoint is not None:
            digest = hashlib.sha256(f"{endpoint}\n{identity}".encode()).hexdigest()
            return (
                f"{self.gpu_task_queue_prefix}-endpoint-{endpoint}-{task}-{model_slug(model)}"
                f"-{digest[:MODEL_HASH_CHARS]}"
            )
        digest = hashlib.sha256(identity.encode()).hexdigest()[:MODEL_HASH_CHARS]
        return f"{self.gpu_task_queue_prefix}-{task}-{model_slug(model)}-{digest}"


def redact(url: str) -> str:
    """``url`` (a DSN or an endpoint) with every credential in it replaced by ``***``.

    The one place secrets are taken out of what llm-batch prints, logs or raises:
    a DSN may carry a password in its user part or its query string, and neither may
    reach a terminal, a log file or an error message.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        # Unparseable: it may still hold a password, so show nothing of it.
        return REDACTED
    netloc = parts.netloc
    if password is not None:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, REDACTED if any(s in k.lower() for s in _SECRET_PARAMS) else v) for k, v in pairs],
            safe="*",
        )
    return urlunsplit(parts._replace(netloc=netloc, query=query))
