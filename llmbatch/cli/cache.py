"""``llm-batch cache stats|purge``: the result cache across jobs, in the ledger."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from llmbatch.cli._support.common import emit_json, fail, out, parse_age, run, with_pool
from llmbatch.contract.names import model_identity

app = typer.Typer(
    name="cache", help="The result cache across jobs: stats, purge.", no_args_is_help=True
)


@app.command("stats")
def stats(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Entries, hits and age of the result cache, per model and weights."""
    from llmbatch.config import Settings
    from llmbatch.dedup import result_cache

    rows = run(with_pool(Settings(), result_cache.stats))
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
    from llmbatch.config import Settings
    from llmbatch.dedup import result_cache

    try:
        age = parse_age(older_than) if older_than is not None else None
    except ValueError as exc:
        raise fail(str(exc)) from None
    name = model_identity(model) if model is not None else None
    deleted = run(
        with_pool(Settings(), lambda pool: result_cache.purge(pool, older_than=age, model=name))
    )
    if as_json:
        emit_json({"deleted": deleted})
    else:
        out.print(f"deleted {deleted} cached results")
