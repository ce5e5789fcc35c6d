"""plan_job and finalize_job on the real stack: a job that can never run fails at once
with InvalidJobSpec, and a job of no items finishes without retries."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.activities.planning import PlanningActivities
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import FinalizeInput, JobLayout, JobSummary
from llmbatch.contract.names import BATCH_JOB_WORKFLOW
from llmbatch.contract.spec import ChatMessage, InputFormat, JobSpec
from llmbatch.contract.states import FailureType, JobState
from llmbatch.workers.cpu import cpu_worker

pytestmark = pytest.mark.slow

# Planning a one-file job takes well under a second: a job that runs into retries
# (seconds apart, growing) would not end within this.
FAST_S = 20


def spec_for(path: Path, tmp_path: Path, **overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": f"plan-{uuid.uuid4().hex[:8]}",
        "inputs": [str(path)],
        "messages": [ChatMessage(role="user", content="{{ x }}")],
        "model": "m",
        "output_uri": f"file://{tmp_path / 'out'}",
    }
    values.update(overrides)
    return JobSpec.model_validate(values)


def own_queue(stack: Settings) -> Settings:
    """The stack on a CPU queue of this test's own: a client registers one worker per
    queue, and the session's workers may already poll the stack's."""
    return stack.model_copy(update={"cpu_task_queue": f"planning-{uuid.uuid4().hex[:8]}"})


async def failure_of(client: Client, settings: Settings, spec: JobSpec) -> ApplicationError:
    """Start ``spec`` as any Temporal client would; the job's failure, which must come
    within FAST_S."""
    handle, started = await start_job(client, spec, settings=settings)
    assert started
    began = time.monotonic()
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), FAST_S)
    assert time.monotonic() - began < FAST_S
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    return cause


async def test_started_directly_jobs_that_can_never_run_fail_fast(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    header_only = tmp_path / "header-only.csv"
    header_only.write_text("x,y\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    cases = [
        (spec_for(header_only, tmp_path), f"input has no rows: {header_only}"),
        (spec_for(empty, tmp_path), f"input has no rows: {empty}"),
    ]
    settings = own_queue(stack)
    async with cpu_worker(settings, client=temporal_client):
        for spec, message in cases:
            cause = await failure_of(temporal_client, settings, spec)
            assert cause.type == FailureType.INVALID_JOB_SPEC
            assert cause.message == message


async def test_a_spec_sent_as_json_that_is_invalid_fails_fast_not_hangs(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    # What a service in another language sends: JSON the Python client would refuse to
    # build. Refused by the data converter, it would fail every workflow task forever.
    data = tmp_path / "rows.jsonl"
    data.write_text('{"x": 1}\n')
    spec = spec_for(data, tmp_path).model_dump(mode="json")
    spec["sampling"]["json_schema"] = {"type": "objekt"}
    settings = own_queue(stack)
    async with cpu_worker(settings, client=temporal_client):
        handle = await temporal_client.start_workflow(
            BATCH_JOB_WORKFLOW,
            {"spec": spec},
            id=spec["job_id"],
            task_queue=settings.cpu_task_queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), FAST_S)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == FailureType.INVALID_JOB_SPEC
    assert cause.message.startswith(
        "invalid job: spec.sampling.json_schema: Value error, json_schema is not a valid "
        "JSON Schema: 'objekt' is not valid"
    )
    assert "\n" not in cause.message


async def test_a_job_of_no_items_is_finalized_at_the_first_attempt(
    stack: Settings, ledger_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # No shard wrote an output part, so nothing exists under the output root yet.
    job_id = f"empty-{uuid.uuid4().hex[:8]}"
    output_root = f"file://{tmp_path / 'out' / job_id}"
    spec = spec_for(tmp_path / "in.jsonl", tmp_path, job_id=job_id)
    await ledger.jobs.upsert_job(
        ledger_pool, job_id=job_id, spec={}, model="m", output_uri=output_root
    )
    finalize = PlanningActivities(ActivityContext(settings=stack, pool=ledger_pool)).finalize_job
    summary = await ActivityEnvironment().run(
        finalize,
        FinalizeInput(
            spec=spec,
            layout=JobLayout(
                job_id=job_id, output_root=output_root, input_format=InputFormat.JSONL
            ),
            summary=JobSummary(job_id=job_id, model="m"),
        ),
    )
    assert (summary.state, summary.items_total) == (JobState.SUCCEEDED, 0)
    manifest = json.loads((tmp_path / "out" / job_id / "manifest.json").read_text())
    assert (manifest["output_parts"], manifest["error_parts"]) == ([], [])
