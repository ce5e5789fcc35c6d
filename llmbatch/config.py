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
from urllib.parse import urlsplit

from pydantic import Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from llmbatch.templates import RenderLimits

CONFIG_ENV_VAR = "LLMBATCH_CONFIG"
DEFAULT_CONFIG_FILE = "llm-batch.toml"


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

    # Prompt templates are caller input: a row's render is bounded (llmbatch.render_pool).
    render_timeout_s: float = Field(
        default=5.0, gt=0, description="Wall-clock limit for rendering one row's prompt."
    )
    render_max_bytes: int = Field(
        default=4 << 20, gt=0, description="Largest rendered prompt (all messages) of a row."
    )
    render_max_memory_mb: int = Field(
        default=1024, gt=0, description="Memory a render process may take beyond its start."
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

    def gpu_task_queue(self, model: str) -> str:
        """The task queue for workers that have ``model`` loaded."""
        return f"{self.gpu_task_queue_prefix}-{model_slug(model)}"


def model_slug(model: str) -> str:
    """A task-queue-safe name for a model id or path (paths keep their last part)."""
    name = model.rstrip("/")
    if name.startswith(("/", ".", "~")):
        name = name.rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower() or "model"
