"""The ledger's side of each engine queue's backlog: unfinished items of running jobs
by model and task (``llm-batch queues``, the queue gauges, KEDA's postgresql trigger).

A job counts from its plan on; its items from the moment their shard starts (a job
runs ``max_concurrent_shards`` shards at once), so a running job's count covers the
shards it runs, and the shards it has not started wait as tasks on the queue.

A job on a remote endpoint counts under that endpoint's queue, never under the GPU
queue of its model; one sent through a provider's Batch API waits on no engine queue
(the CPU workers wait for its batches) and is not counted here.
"""

from __future__ import annotations

from llmbatch.contract.spec import EndpointVia, Task
from llmbatch.contract.states import JobState
from llmbatch.ledger.db import TERMINAL, Database

# One row per (model, task, endpoint) of running jobs; endpoint NULL: own engines.
UNFINISHED_SQL = """
SELECT j.model, coalesce(j.spec->>'task', $3) AS task, j.spec->>'remote_endpoint' AS endpoint,
       count(i.item_id) FILTER (WHERE i.status <> ALL($2::text[])) AS unfinished,
       count(DISTINCT j.job_id) AS jobs
FROM jobs j LEFT JOIN items i ON i.job_id = j.job_id
WHERE j.status = $1 AND coalesce(j.spec->>'via', $4) <> $5
GROUP BY 1, 2, 3
"""


async def unfinished_by_model(
    db: Database,
) -> dict[tuple[str, str, str | None], tuple[int, int]]:
    """(model, task, remote endpoint or None) → (unfinished items, running jobs) of the
    ledger's running jobs that wait on an engine queue."""
    rows = await db.fetch(
        UNFINISHED_SQL, JobState.RUNNING, TERMINAL, Task.GENERATE,
        EndpointVia.ONLINE, EndpointVia.BATCH,
    )  # fmt: skip
    return {(r["model"], r["task"], r["endpoint"]): (r["unfinished"], r["jobs"]) for r in rows}


def unfinished_items_query(model: str, task: Task) -> str:
    """The unfinished items of ``model`` and ``task`` as one SQL statement with its
    values inline, for KEDA's postgresql trigger (which binds no parameters): the
    manifests under deploy/k8s carry exactly this text (a test checks)."""

    def literal(value: str) -> str:
        return "'" + value.replace("'", "''") + "'"

    terminal = ", ".join(literal(s) for s in TERMINAL)
    return (
        "SELECT count(*) FROM items i JOIN jobs j ON j.job_id = i.job_id "
        f"WHERE j.status = {literal(JobState.RUNNING)} AND j.model = {literal(model)} "
        f"AND coalesce(j.spec->>'task', {literal(Task.GENERATE)}) = {literal(task)} "
        "AND j.spec->>'remote_endpoint' IS NULL "
        f"AND i.status NOT IN ({terminal})"
    )
