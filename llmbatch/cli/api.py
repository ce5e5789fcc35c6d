"""``llm-batch serve`` (the OpenAI Batch API) and ``llm-batch api-key create|list|revoke``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from llmbatch.cli._support.common import CliError, JsonOption, emit_json, out, run

if TYPE_CHECKING:
    import asyncpg

    from llmbatch.config import Settings

app = typer.Typer()
keys_app = typer.Typer(no_args_is_help=True)
app.add_typer(keys_app, name="api-key", help="API keys of the OpenAI Batch API.")


@app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int | None, typer.Option(help="Port to listen on (default: LLMBATCH_API_PORT, 8000).")
    ] = None,
) -> None:
    """Serve the OpenAI Batch API (files, batches, models) over HTTP.

    Stateless: run as many as you like behind a load balancer. Callers need an API
    key (`llm-batch api-key create --project NAME`).
    """
    import uvicorn

    from llmbatch.api.app import create_app
    from llmbatch.config import Settings

    settings = Settings()
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port if port is not None else settings.api_port,
        log_level="info",
        # No "server: uvicorn" header: callers need not learn what runs behind the API.
        server_header=False,
    )


async def _pool(settings: Settings) -> asyncpg.Pool:
    from llmbatch import ledger

    return await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=1)


@keys_app.command("create")
def create_key(
    project: Annotated[str, typer.Option(help="The project the key acts for.")],
    as_json: JsonOption = False,
) -> None:
    """Make a key for PROJECT and print it once (only its hash is kept)."""
    from llmbatch.config import Settings

    run(_create(Settings(), project=project, as_json=as_json))


async def _create(settings: Settings, *, project: str, as_json: bool) -> None:
    from llmbatch.api.auth import create_key as new_key
    from llmbatch.contract.priority import TENANT_PATTERN

    if re.fullmatch(TENANT_PATTERN, project) is None:
        # A project is its batches' tenant, so it is named as tenants are.
        raise CliError(
            "--project must be 1 to 64 characters: letters, digits and ._:@/- (not first)"
        )
    pool = await _pool(settings)
    try:
        key = await new_key(pool, project=project)
    finally:
        await pool.close()
    if as_json:
        emit_json({"key_id": key.key_id, "project": key.project, "key": key.secret})
        return
    out.print(f"key {key.key_id} for project {key.project} (shown once; keep it secret):")
    # Plain print: a terminal's soft wrap must not break the key for copy and paste.
    typer.echo(key.secret)


@keys_app.command("list")
def list_keys(as_json: JsonOption = False) -> None:
    """List keys (ids and projects; never the keys themselves)."""
    from llmbatch.config import Settings

    run(_list(Settings(), as_json=as_json))


async def _list(settings: Settings, *, as_json: bool) -> None:
    from llmbatch.ledger import api_records

    pool = await _pool(settings)
    try:
        keys = await api_records.list_keys(pool)
    finally:
        await pool.close()
    rows = [
        {
            "key_id": k.key_id,
            "project": k.project,
            "created_at": k.created_at.isoformat(),
            "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        }
        for k in keys
    ]
    if as_json:
        emit_json(rows)
        return
    if not rows:
        out.print("no API keys; make one with: llm-batch api-key create --project NAME")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("key", "project", "created", "revoked"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["key_id"], row["project"], row["created_at"], row["revoked_at"] or "")
    out.print(table)


@keys_app.command("revoke")
def revoke_key(key_id: Annotated[str, typer.Argument(help="The key's id (key_...).")]) -> None:
    """Revoke a key: calls with it answer 401 from now on."""
    from llmbatch.config import Settings

    run(_revoke(Settings(), key_id=key_id))


async def _revoke(settings: Settings, *, key_id: str) -> None:
    from llmbatch.ledger import api_records

    pool = await _pool(settings)
    try:
        revoked = await api_records.revoke_key(pool, key_id=key_id)
    finally:
        await pool.close()
    if not revoked:
        raise CliError(f"no live key {key_id} (see llm-batch api-key list)")
    out.print(f"key {key_id} revoked")
