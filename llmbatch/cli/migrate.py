"""``llm-batch migrate``."""

from __future__ import annotations

from urllib.parse import urlsplit

import typer

from llmbatch.cli._support.common import fail

app = typer.Typer()


@app.command("migrate")
def migrate_command() -> None:
    """Apply the SQL migrations to the configured Postgres."""
    import asyncio

    import asyncpg

    from llmbatch.config import Settings
    from llmbatch.ledger.migrate import MigrationError, apply_migrations

    settings = Settings()
    dsn = settings.postgres_dsn.get_secret_value()
    try:
        applied = asyncio.run(apply_migrations(dsn, settings.migrations_dir))
    except MigrationError as exc:
        raise fail(f"migrations not applied: {exc}") from None
    except OSError as exc:
        # Refused, timed out, no such socket: the server is not there.
        raise fail(f"cannot reach Postgres at {_where(dsn)}: {exc}") from None
    except asyncpg.PostgresError as exc:
        # Reached, but refused: no such database, authentication, permissions.
        raise fail(f"Postgres at {_where(dsn)} refused: {type(exc).__name__}: {exc}") from None
    except (asyncpg.InterfaceError, ValueError) as exc:
        raise fail(f"cannot use the Postgres DSN (LLMBATCH_POSTGRES_DSN): {exc}") from None
    if applied:
        typer.echo(f"applied {', '.join(applied)}")
    else:
        typer.echo("database schema is up to date")


def _where(dsn: str) -> str:
    """Host, port and database of a DSN, without its user or password."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "local socket"
        port = parts.port or 5432
    except ValueError:
        return "the configured DSN"
    database = parts.path.lstrip("/") or "postgres"
    return f"{host}:{port}/{database}"
