"""Templates that run away, on the real stack (session workers, vLLM CPU engine).

A template is caller input: a row that makes it loop for ever, build a huge range or
a huge string dies as a TemplateError with a message that names the template, not
the row; the shard goes on, and other jobs on the same worker never notice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmbatch import ledger
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import DeadLetterView
from llmbatch.contract.messages import JobProgress
from llmbatch.contract.names import (
    DEAD_LETTERS_QUERY,
    PREPARE_SHARD,
    PROGRESS_QUERY,
    dead_letter_workflow_id,
    shard_workflow_id,
)
from llmbatch.contract.spec import ChatMessage, JobSpec, SamplingSpec
from tests.fixtures.worker_processes import items_by_id, job_result
from tests.workflows.test_batch_job import classify_on_disk, companies

pytestmark = pytest.mark.slow

SECRET = "4111-1111-1111-1111"
# One template, four ways for a row to break it (the first row renders fine, so the
# job passes the check at submit, as a job whose later rows are poison would).
POISONED = (
    "{% if kind == 'loop' %}{% for i in range(n) %}{% for j in range(n) %}{% endfor %}"
    "{% endfor %}{% elif kind == 'range' %}{% for i in range(n) %}.{% endfor %}"
    "{% elif kind == 'blowup' %}{{ text * n }}{% elif kind == 'lookup' %}{{ labels[text] }}"
    "{% endif %}Say {{ text }}."
)


def row(item_id: str, kind: str, n: int, text: str = "hi") -> dict[str, Any]:
    return {"id": item_id, "kind": kind, "n": n, "text": text, "labels": {"a": "b"}}


def poisoned_job(tmp_path: Path, rows: list[dict[str, Any]], model: str) -> JobSpec:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return JobSpec(
        job_id=f"runaway-{uuid.uuid4().hex[:8]}",
        inputs=[str(source)],
        id_field="id",
        messages=[ChatMessage(role="user", content=POISONED)],
        model=model,
        sampling=SamplingSpec(max_tokens=4),
        output_uri=f"file://{tmp_path / 'out'}",
    )


async def render_running(client: Client, job_id: str) -> bool:
    """Whether the job's shard 0 has its prepare_shard step (which renders) under way."""
    try:
        described = await client.get_workflow_handle(shard_workflow_id(job_id, 0)).describe()
    except Exception:  # the shard has not started yet
        return False
    return any(
        p.activity_type.name == PREPARE_SHARD for p in described.raw_description.pending_activities
    )


async def test_runaway_huge_range_and_blow_up_rows_die_alone_with_safe_messages(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    rows = [
        row("ok-0", "ok", 1),
        row("loop", "loop", 100_000),
        row("range", "range", 100_000_000),
        row("blowup", "blowup", 100_000_000, text="ab"),
        row("lookup", "lookup", 1, text=SECRET),
        *(row(f"ok-{i}", "ok", i) for i in range(1, 6)),
    ]
    spec = poisoned_job(tmp_path, rows, model_name)
    started = time.monotonic()
    handle, _ = await start_job(temporal_client, spec, settings=workers)
    summary = await asyncio.wait_for(job_result(handle), 300)
    took = time.monotonic() - started

    assert summary.state == "completed_with_errors"
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (10, 6, 4)
    pool = await ledger.db.create_pool(workers.postgres_dsn.get_secret_value())
    try:
        items = await items_by_id(pool, spec.job_id)
    finally:
        await pool.close()
    expected = {
        "loop": f"took longer than the {workers.render_timeout_s:g} s limit",
        "range": "OverflowError",
        "blowup": "too large",
        "lookup": "UndefinedError",
    }
    for item_id, words in expected.items():
        item = items[item_id]
        assert (item["status"], item["error_class"]) == ("dead", "TemplateError"), item
        assert words in item["error_message"] and "message 0 (user)" in item["error_message"]
    # The row's value is nowhere: not in the ledger, not in the dead-letter list.
    assert all(SECRET not in (i["error_message"] or "") for i in items.values())
    view = await temporal_client.get_workflow_handle(dead_letter_workflow_id(spec.job_id)).query(
        DEAD_LETTERS_QUERY, result_type=DeadLetterView
    )
    assert view.dead == 4 and SECRET not in view.model_dump_json()
    assert {e.source for e in view.entries} == {f"{spec.inputs[0]}:line {n}" for n in (2, 3, 4, 5)}
    # Row errors are no step failure: no step of the shard (prepare_shard included) was retried.
    history = await temporal_client.get_workflow_handle(
        shard_workflow_id(spec.job_id, 0)
    ).fetch_history()
    renders = [
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    assert renders and max(renders) == 1
    print(f"\npoisoned job of 10 rows finished in {took:.1f} s")


async def test_a_runaway_template_leaves_a_concurrent_job_and_its_queries_alone(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    runaway_rows = 6
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    runaway = poisoned_job(
        tmp_path / "a",
        [row("ok-0", "ok", 1), *(row(f"loop-{i}", "loop", 100_000) for i in range(runaway_rows))],
        model_name,
    )
    other = classify_on_disk(tmp_path / "b", companies(20), model_name)
    runaway_handle, _ = await start_job(temporal_client, runaway, settings=workers)
    for _ in range(600):
        if await render_running(temporal_client, runaway.job_id):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the runaway job's render never started")

    started = time.monotonic()
    other_handle, _ = await start_job(temporal_client, other, settings=workers)
    slowest_query = 0.0
    result = asyncio.create_task(job_result(other_handle))
    while not result.done():
        asked = time.monotonic()
        await asyncio.wait_for(
            other_handle.query(PROGRESS_QUERY, result_type=JobProgress), timeout=10
        )
        slowest_query = max(slowest_query, time.monotonic() - asked)
        await asyncio.wait([result], timeout=0.5)
    summary = result.result()
    other_took = time.monotonic() - started

    assert summary.state == "succeeded" and summary.items_succeeded == 20
    assert slowest_query < 3, f"a progress query took {slowest_query:.1f} s"
    # All of that happened while the runaway rows were rendering.
    assert await render_running(temporal_client, runaway.job_id)
    runaway_summary = await asyncio.wait_for(job_result(runaway_handle), 300)
    assert (runaway_summary.items_succeeded, runaway_summary.items_dead) == (1, runaway_rows)
    print(
        f"\nother job: done in {other_took:.1f} s while the runaway rendered; slowest "
        f"progress query {slowest_query:.2f} s"
    )
