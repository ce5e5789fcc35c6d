"""``llm-batch cache stats|purge``: the result cache across jobs, in the ledger."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Annotated, Any, TypeVar

import typer

from llmbatch.cli.common import CliError, emit_json, fail, out, run
from llmbatch.config import Settings
from llmbatch.contract.names import model_identity

app = typer.Typer(no_args_is_help=True)

T = TypeVar("T")

_AGE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s`` as a duration."""
    match = _AGE.match(text)
    if match is None:
        raise ValueError(f"--older-than {text!r} is not an age like 30d, 12h, 90m, 2w")
    return timedelta(seconds=int(match[1]) * _UNIT_S[match[2]])


async def _with_pool(settings: Settings, use: Callable[[Any], Awaitable[T]]) -> T:
    from llmbatch import ledger

    try:
        pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value(), max_size=2)
    except OSError as exc:
        raise CliError(f"cannot reach Postgres: {exc}") from None
    try:
        return await use(pool)
    finally:
        await pool.close()


@app.command("stats")
def stats(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Entries, hits and age of the result cache, per model and weights."""
    from llmbatch.dedup import result_cache

    rows = run(_with_pool(Settings(), result_cache.stats))
    if as_json:
        emit_json([dataclasses.asdict(r) for r in rows])
        return
    if not rows:
        out.print("the result cache is empty")
        return
    for r in rows:
        out.print(
            f"{r.model} (weights {r.weights[:23]}): {r.entries} entries, {r.hits} hits, "
            f"{r.oldest:%Y-%m-%d %H:%M} .. {r.newest:%Y-%m-%d %H:%M}",
            highlight=False,
        )


@app.command("purge")
def purge(
    older_than: Annotated[
        str | None, typer.Option(help="Only entries older than this: 30d, 12h, 90m, 2w.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Only this model's entries.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Delete cached results (all of them unless --older-than or --model narrow it)."""
    from llmbatch.dedup import result_cache

    try:
        age = parse_age(older_than) if older_than is not None else None
    except ValueError as exc:
        raise fail(str(exc)) from None
    name = model_identity(model) if model is not None else None
    deleted = run(
        _with_pool(Settings(), lambda pool: result_cache.purge(pool, older_than=age, model=name))
    )
    if as_json:
        emit_json({"deleted": deleted})
    else:
        out.print(f"deleted {deleted} cached results")
