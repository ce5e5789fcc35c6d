"""One settings model for every process: CLI, workers, the embedded stack.

Values come from, highest first: keyword arguments, ``LLMBATCH_*`` environment
variables, a TOML file (``LLMBATCH_CONFIG`` or ``./llm-batch.toml``), defaults.
The defaults point at the embedded stack, so a real deployment changes only
settings, never code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

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

    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "llm-batch"
    temporal_ui_port: int = 8233
    cpu_task_queue: str = "llm-batch-cpu"
    gpu_task_queue_prefix: str = Field(
        default="llm-batch-gpu",
        description="GPU queues are named '<prefix>-<model>' so a worker only takes its model.",
    )

    postgres_dsn: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:55432/llmbatch")
    migrations_dir: Path | None = Field(
        default=None,
        description="A folder of NNNN_name.sql files to apply instead of the migrations "
        "shipped with llm-batch (unset: the shipped ones, wherever it is installed).",
    )

    s3_endpoint_url: str | None = "http://127.0.0.1:8333"
    s3_region: str = "us-east-1"
    s3_access_key_id: SecretStr = SecretStr("llmbatch")
    s3_secret_access_key: SecretStr = SecretStr("llmbatch-secret")
    s3_bucket: str = "llm-batch"

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

    def gpu_task_queue(self, model: str) -> str:
        """The task queue for workers that have ``model`` loaded."""
        return f"{self.gpu_task_queue_prefix}-{model_slug(model)}"


def model_slug(model: str) -> str:
    """A task-queue-safe name for a model id or path (paths keep their last part)."""
    name = model.rstrip("/")
    if name.startswith(("/", ".", "~")):
        name = name.rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower() or "model"


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
