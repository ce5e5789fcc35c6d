"""The settings reference: every ``LLMBATCH_*`` variable of :class:`llmbatch.config.Settings`."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from llmbatch.config import CONFIG_ENV_VAR, DEFAULT_CONFIG_FILE, Settings
from llmbatch.reference.markdown import code, page, symbolic, table

_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def render() -> str:
    prefix = Settings.model_config.get("env_prefix", "")
    rows = [
        (code(f"{prefix}{name.upper()}"), _default(field), _description(field))
        for name, field in Settings.model_fields.items()
    ]
    return page(
        "Settings",
        "Every process (CLI, workers, `llm-batch serve`, the embedded stack) reads one "
        "settings model, `llmbatch.config.Settings`. Each value comes from, highest first: "
        f"the `LLMBATCH_*` environment variable, a TOML file (`{CONFIG_ENV_VAR}`, else "
        f"`./{DEFAULT_CONFIG_FILE}` when it exists; keys are the names below without the "
        "prefix, in lower case), the default. The defaults point at the embedded stack "
        "(`llm-batch dev up`). Connection security for Temporal (TLS, client certificates, "
        "API keys) is Temporal's own `TEMPORAL_*` configuration: see "
        "[Connecting to a secured Temporal](../guides/production/tls.md).",
        [table(["Variable", "Default", "Description"], rows)],
    )


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    return code(symbolic(_text(value))) if value is not None else "unset"


def _text(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, timedelta):
        return f"{int(value.total_seconds())}s"
    if isinstance(value, list | tuple):
        return os.pathsep.join(_text(v) for v in value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _description(field: FieldInfo) -> str:
    text = field.description or ""
    bounds = [
        f"{symbol} {_text(getattr(meta, attr))}"
        for meta in field.metadata
        for kind, attr, symbol in _BOUNDS
        if isinstance(meta, kind)
    ]
    if bounds:
        text += f" ({', '.join(bounds)})"
    return text
