"""``llm-batch purge``: delete finished jobs' item rows from the ledger (retention)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from llmbatch.cli._support.common import (
    CliError,
    JsonOption,
    emit_json,
    err,
    fail,
    out,
    parse_age,
    run,
    with_pool,
)

app = typer.Typer()


@app.command("purge")
def purge(
    job: Annotated[
        list[str] | None, typer.Option("--job", help="A finished job to purge (repeatable).")
    ] = None,
    older_than: Annotated[
        str | None,
        typer.Option(help="Every finished job that ended longer ago than this: 30d, 12h, 2w."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Delete finished jobs' item rows, dead letters, shard plans and dedup leads from
    the ledger; keep each job's own row (state, totals) and its outputs in storage.

    Running and paused jobs, and jobs whose dead items a re-drive is running, are never
    touched: a job named with --job that is not finished is refused.
    """
    from llmbatch.config import Settings

    if not job and older_than is None:
        raise fail("say what to purge: --job ID, --older-than AGE, or both")
    try:
        before = datetime.now(UTC) - parse_age(older_than) if older_than is not None else None
    except ValueError as exc:
        raise fail(str(exc)) from None
    purged = run(with_pool(Settings(), lambda pool: _purge(pool, jobs=job or [], before=before)))
    if as_json:
        emit_json([dataclasses.asdict(p) for p in purged])
        return
    for p in purged:
        ended = f", ended {p.finished_at:%Y-%m-%d %H:%M}" if p.finished_at else ""
        out.print(
            f"purged {p.job_id} ({p.state}{ended}): {p.items} items, {p.dead_letters} dead "
            f"letters, {p.shards} shards, {p.dedup_leads} dedup leads",
            highlight=False,
        )
    total = sum(p.items for p in purged)
    out.print(f"purged {len(purged)} jobs, {total} items", highlight=False)


async def _purge(pool: Any, *, jobs: list[str], before: datetime | None) -> list[Any]:
    from llmbatch.ledger import retention

    try:
        # Named jobs are checked first, so a refused one stops the command before
        # anything is deleted.
        for job_id in jobs:
            await retention.check_purgeable(pool, job_id=job_id)
        purged = [await retention.purge_job(pool, job_id=job_id) for job_id in dict.fromkeys(jobs)]
    except retention.NotPurgeable as exc:
        raise CliError(str(exc)) from None
    if before is None:
        return purged
    for job_id in await retention.jobs_finished_before(pool, before=before):
        if job_id in jobs:
            continue
        try:
            purged.append(await retention.purge_job(pool, job_id=job_id))
        except retention.NotPurgeable as exc:  # a re-drive runs: its turn comes later
            err.print(f"skipped: {exc}", highlight=False)
    return purged
