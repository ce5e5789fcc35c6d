"""``llm-batch queues``: each engine task queue's backlog, pollers and unfinished items."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from llmbatch.cli._support.common import emit_json, out, run
from llmbatch.contract.progress import format_duration

if TYPE_CHECKING:
    from llmbatch.client.queues import QueueBacklog
    from llmbatch.config import Settings

app = typer.Typer()


@app.command("queues")
def queues(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show each engine task queue: Temporal's backlog (tasks waiting, oldest age,
    add and dispatch rates), its pollers, and the ledger's unfinished items for its
    model and task. A queue with no poller and unfinished items waits for a worker."""
    from llmbatch.config import Settings

    run(_queues(Settings(), as_json=as_json))


async def _queues(settings: Settings, *, as_json: bool) -> None:
    from llmbatch import ledger
    from llmbatch.client.temporal import connect
    from llmbatch.workers.queues import read_queues

    client = await connect(settings, tracing=False)
    pool = await ledger.db.create_pool(
        settings.postgres_dsn.get_secret_value(), min_size=1, max_size=2
    )
    try:
        found = await read_queues(client, pool, settings)
    finally:
        await pool.close()
    if as_json:
        emit_json([q.as_json() for q in found])
        return
    if not found:
        out.print("no engine task queue yet: no GPU worker has run and no job is running")
        return
    table = Table("model", "task", "task queue", "backlog", "oldest", "rate in/out", "pollers",
                  "unfinished items", box=None)  # fmt: skip
    for q in found:
        table.add_row(
            escape(q.model),
            q.task,
            q.task_queue,
            str(q.backlog),
            format_duration(q.backlog_age_s) if q.backlog else "-",
            f"{q.add_rate:g}/{q.dispatch_rate:g} per s",
            str(q.pollers),
            _unfinished(q),
        )
    out.print(table)


def _unfinished(q: QueueBacklog) -> str:
    if not q.unfinished_items:
        return "0"
    waits = " (waits for a worker)" if q.pollers == 0 else ""
    return f"{q.unfinished_items} in {q.running_jobs} job(s){waits}"
