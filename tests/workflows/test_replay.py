"""Determinism: histories of real runs of every workflow replay with no difference.

One job runs end to end on a Temporal server of its own whose histories count as
long after 60 events, so its BatchJobWorkflow continues as new (more than once); a
row with a missing template field dies, so its DeadLetterWorkflow starts, and a
re-drive runs through it. Every run of every workflow is then fetched and replayed
by Temporal's Replayer with the same workflow classes and data converter the
workers use: any non-deterministic code path fails the replay.

Histories recorded by earlier releases (tests/workflows/histories, one file per run,
written by this test with LLMBATCH_RECORD_HISTORIES=1) are replayed by the current
code too: a release whose workflow code would break the jobs still running when it
is deployed fails here (docs/operations/kubernetes.md, "Upgrades").
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter

from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import RedriveRequest, RedriveResult
from llmbatch.contract.names import (
    BATCH_JOB_WORKFLOW,
    DEAD_LETTER_WORKFLOW,
    REDRIVE_UPDATE,
    SHARD_WORKFLOW,
    dead_letter_workflow_id,
)
from llmbatch.contract.states import ErrorClass
from llmbatch.engine.vllm_engine import Engine
from llmbatch.workers.cpu import cpu_worker
from llmbatch.workers.gpu import gpu_worker
from llmbatch.workflows.batch_job import BatchJobWorkflow
from llmbatch.workflows.dead_letter import DeadLetterWorkflow
from llmbatch.workflows.shard import ShardWorkflow
from tests.fixtures.replay import replayer
from tests.fixtures.small_history import one_row_shard_job, small_history_env

pytestmark = pytest.mark.slow

SHARDS = 24
RECORDED = Path(__file__).parent / "histories"
WORKFLOWS = [BatchJobWorkflow, ShardWorkflow, DeadLetterWorkflow]
DEAD_ROW = 5  # has no "n": its template fails, so it dies and the DLQ starts


async def histories(client: Client, workflow_id: str) -> list[WorkflowHistory]:
    """Every run of ``workflow_id``, oldest first."""
    runs = [e async for e in client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    return [
        await client.get_workflow_handle(workflow_id, run_id=run.run_id).fetch_history()
        for run in sorted(runs, key=lambda r: r.start_time)
    ]


async def test_every_workflow_replays_deterministically(
    stack: Settings, engine: Engine, model_name: str, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"m": i} if i == DEAD_ROW else {"n": i}) + "\n" for i in range(SHARDS))
    )
    spec = one_row_shard_job(f"replay-{uuid.uuid4().hex[:8]}", source, model_name, tmp_path / "out")
    # With a priority and a tenant, so the commands that carry them are replayed too
    # (a spec without them gives the same commands as before they existed).
    spec = spec.model_copy(update={"priority": 2, "tenant": "replay", "tenant_weight": 1.5})
    async with small_history_env(stack) as env:
        client = env.client
        async with (
            cpu_worker(stack, client=client),
            gpu_worker(stack, engine, model=model_name, client=client),
        ):
            handle, _ = await start_job(client, spec, settings=stack)
            summary = await asyncio.wait_for(handle.result(), 300)
            dlq = client.get_workflow_handle(dead_letter_workflow_id(spec.job_id))
            redrive = await asyncio.wait_for(
                dlq.execute_update(
                    REDRIVE_UPDATE,
                    RedriveRequest(error_classes=[ErrorClass.TEMPLATE_ERROR]),
                    result_type=RedriveResult,
                ),
                300,
            )

            job_runs = await histories(client, spec.job_id)
            shard_runs = [
                h
                for n in range(SHARDS)
                for h in await histories(client, f"{spec.job_id}/shard-{n:05d}")
            ]
            shard_runs += [
                h
                for n in redrive.shards
                for h in await histories(
                    client, f"{spec.job_id}/redrive-{redrive.redrive}/shard-{n:05d}"
                )
            ]
            dlq_runs = await histories(client, dead_letter_workflow_id(spec.job_id))
            statuses = [
                e.status async for e in client.list_workflows(f"WorkflowId = '{spec.job_id}'")
            ]

    # The job really went through every path the replay is meant to cover.
    assert (summary.items_succeeded, summary.items_dead) == (SHARDS - 1, 1)
    assert redrive.redrive >= 1 and redrive.shards == [DEAD_ROW]
    assert statuses.count(WorkflowExecutionStatus.CONTINUED_AS_NEW) >= 1
    assert len(job_runs) >= 2 and len(shard_runs) == SHARDS + 1 and dlq_runs

    if os.environ.get("LLMBATCH_RECORD_HISTORIES"):
        # One file per run: every job run, the first shard, the re-driven shard, the DLQ.
        record(RECORDED, [*job_runs, shard_runs[0], shard_runs[-1], *dlq_runs])
    replaying = replayer(WORKFLOWS, data_converter=pydantic_data_converter)
    replayed: dict[str, int] = {}
    for history in [*job_runs, *shard_runs, *dlq_runs]:
        # Raises on a non-determinism error (or any other workflow task failure).
        result = await replaying.replay_workflow(history)
        assert result.replay_failure is None, history.workflow_id
        replayed[_kind(history)] = replayed.get(_kind(history), 0) + 1
    assert replayed.keys() == {BATCH_JOB_WORKFLOW, SHARD_WORKFLOW, DEAD_LETTER_WORKFLOW}
    print(f"\nreplayed {replayed} with no non-determinism")


def _kind(history: WorkflowHistory) -> str:
    return history.events[0].workflow_execution_started_event_attributes.workflow_type.name


def record(folder: Path, runs: list[WorkflowHistory]) -> None:
    """Write ``runs`` as recorded histories of this release, replacing its earlier ones."""
    from importlib.metadata import version

    release = version("llm-batch")
    folder.mkdir(exist_ok=True)
    for old in folder.glob(f"{release}-*.json"):
        old.unlink()
    for n, history in enumerate(runs):
        # The workflow id with the history: workflows read it (a job's id is its own).
        recorded = {"workflow_id": history.workflow_id, "history": json.loads(history.to_json())}
        (folder / f"{release}-{n:02d}-{_kind(history)}.json").write_text(json.dumps(recorded))


async def test_histories_recorded_by_earlier_releases_replay() -> None:
    files = sorted(RECORDED.glob("*.json"))
    replaying = replayer(WORKFLOWS, data_converter=pydantic_data_converter)
    kinds: set[str] = set()
    for path in files:
        recorded = json.loads(path.read_text())
        history = WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])
        result = await replaying.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
        kinds.add(_kind(history))
    # Every workflow type has a recorded history to be replayed.
    assert kinds == {BATCH_JOB_WORKFLOW, SHARD_WORKFLOW, DEAD_LETTER_WORKFLOW}
