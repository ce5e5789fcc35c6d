"""``llm-batch migrate``."""

from __future__ import annotations


def migrate_command() -> None:
    """Apply the SQL migrations to the configured Postgres."""
    raise NotImplementedError
