"""``llm-batch migrate``."""

from __future__ import annotations

import asyncio

import typer

from llmbatch.config import Settings


def migrate_command() -> None:
    """Apply the SQL migrations to the configured Postgres."""
    import asyncpg

    from llmbatch.migrate import MigrationError, apply_migrations

    settings = Settings()
    try:
        applied = asyncio.run(
            apply_migrations(settings.postgres_dsn.get_secret_value(), settings.migrations_dir)
        )
    except (MigrationError, OSError, asyncpg.PostgresError) as exc:
        typer.echo(f"error: migrations failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"applied {', '.join(applied)}" if applied else "database schema is up to date")
