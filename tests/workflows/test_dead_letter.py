"""Poison rows end dead with their line numbers; the dead-letter list shows them and a
re-drive with a fix brings them back (real stack, real engine, the real CLI)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from temporalio.client import Client

from llmbatch import storage
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract.dead_letters import DeadLetterView
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import dead_letter_workflow_id
from llmbatch.workflows.dead_letter import DeadLetterWorkflow
from llmbatch.workflows.shard import ShardWorkflow
from tests.fixtures.replay import replayer
from tests.llmbatch.cli.test_jobs import cli
from tests.workflows.test_batch_job import LABELS, classify, ledger_counts, output_rows, run

pytestmark = pytest.mark.slow

GOOD = 40
MAX_ROW_BYTES = 4096


def poisoned_input() -> tuple[bytes, dict[str, tuple[str, int]]]:
    """JSONL with good rows and one row of each kind that can never succeed as is;
    returns the bytes and, per poison row, its expected error class and line."""
    lines: list[bytes] = [
        json.dumps({"id": f"ok-{i}", "name": f"Clinic {i}"}).encode() for i in range(GOOD)
    ]
    poison = {
        "bad-json": (b'{"id": "bad-json", "name": "Acme', "InvalidRow"),
        "bad-utf8": (b'{"id": "bad-utf8", "name": "Caf\xe9 \xff"}', "InvalidRow"),
        "too-big": (json.dumps({"id": "too-big", "name": "x" * 5000}).encode(), "RowTooLarge"),
        "no-name": (json.dumps({"id": "no-name", "city": "Lyon"}).encode(), "TemplateError"),
        # ~600 tokens of the tiny model against a 512-token context.
        "long": (
            json.dumps({"id": "long", "name": "alpha beta gamma delta " * 150}).encode(),
            "PromptTooLong",
        ),
    }
    expected: dict[str, tuple[str, int]] = {}
    for k, (item, (line, error_class)) in enumerate(poison.items()):
        at = 5 + 7 * k  # spread among the good rows, 0-based
        lines.insert(at, line)
        expected[item] = (error_class, 0)
    for number, line in enumerate(lines, start=1):
        for item in poison:
            if poison[item][0] == line:
                expected[item] = (expected[item][0], number)
    return b"\n".join(lines) + b"\n", expected


async def dlq(settings: Settings, *args: str) -> tuple[int, Any, str]:
    code, out, err = await cli(settings, "dlq", *args, "--json")
    return code, (json.loads(out) if code == 0 else None), err


async def test_poison_rows_are_dead_lettered_and_a_redrive_brings_the_fixable_back(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    data, expected = poisoned_input()
    uri = f"s3://{bucket}/in/poisoned.jsonl"
    storage.stores.open_store(uri, workers).put_bytes(uri, data)
    spec = classify(
        inputs=[uri],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        job_id=f"poison-{uuid.uuid4().hex[:8]}",
        id_field="id",
        shard_size=20,
        max_row_bytes=MAX_ROW_BYTES,
    )
    total = GOOD + len(expected)

    summary = await run(temporal_client, workers, spec)

    assert summary.state == "completed_with_errors"
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (total, GOOD, 5)

    # The list names each poison row's class and its line in the input. Unreadable rows
    # have no id of their own: they are known by position.
    code, view, err = await dlq(workers, "list", spec.job_id)
    assert code == 0, err
    assert view["dead"] == 5 and view["listed_all"]
    by_line = {e["source"]: e for e in view["entries"]}
    for item, (error_class, line) in expected.items():
        entry = by_line[f"{uri}:line {line}"]
        assert entry["error_class"] == error_class, (item, entry)
        assert entry["attempts"] >= (1 if error_class == "PromptTooLong" else 0)
        if error_class not in ("InvalidRow", "RowTooLarge"):
            assert entry["item_id"] == item

    # Every row has one output line; the dead ones are also in the error files.
    out = output_rows(workers, summary)
    assert len(out) == total and len({r["item_id"] for r in out}) == total
    assert sum(r["error"] is not None for r in out) == 5
    assert len(error_lines(workers, summary)) == 5

    # A re-drive with a fix: the prompt that was too long is cut to fit and succeeds.
    code, result, err = await dlq(
        workers,
        "redrive",
        spec.job_id,
        "--class",
        "PromptTooLong",
        "--set",
        "truncate_prompt_tokens=200",
    )
    assert code == 0, err
    assert (result["requeued"], result["succeeded"], result["dead"]) == (1, 1, 0)
    code, view, err = await dlq(workers, "list", spec.job_id)
    assert code == 0, err
    assert view["dead"] == 4 and "PromptTooLong" not in view["by_class"]
    job = JobSummary.model_validate(view["job"])
    assert (job.items_succeeded, job.items_dead, job.state) == (
        GOOD + 1,
        4,
        "completed_with_errors",
    )
    code, status, err = await cli(workers, "status", spec.job_id, "--json")
    assert code == 0, err
    assert (json.loads(status)["items_succeeded"], json.loads(status)["items_dead"]) == (
        GOOD + 1,
        4,
    )
    out = output_rows(workers, job)
    (long_row,) = [r for r in out if r["item_id"] == "long"]
    assert long_row["error"] is None and long_row["text"] in LABELS
    assert len(out) == total and len(error_lines(workers, job)) == 4

    # A re-drive without a fix changes nothing: the same four die again.
    code, result, err = await dlq(workers, "redrive", spec.job_id)
    assert code == 0, err
    assert (result["requeued"], result["succeeded"], result["dead"]) == (4, 0, 4)
    code, view, err = await dlq(workers, "list", spec.job_id)
    assert code == 0, err
    assert view["dead"] == 4 and len(view["redrives"]) == 2

    # Bad re-drives are refused in one line.
    code, _, err = await dlq(workers, "redrive", spec.job_id, "--set", "temperature=9")
    assert code == 1 and "temperature" in err and len(err.strip().splitlines()) == 1
    code, _, err = await dlq(workers, "list", "no-such-job")
    assert code == 1 and "no job 'no-such-job'" in err

    # The dead-letter workflow's real history replays without non-determinism.
    handle = temporal_client.get_workflow_handle(dead_letter_workflow_id(spec.job_id))
    view_now = await handle.query("dead_letters", result_type=DeadLetterView)
    assert view_now.dead == 4
    history = await handle.fetch_history()
    await replayer(
        [DeadLetterWorkflow, ShardWorkflow],
        data_converter=temporal_client.data_converter,
    ).replay_workflow(history)


def error_lines(settings: Settings, summary: JobSummary) -> list[dict[str, Any]]:
    store = storage.stores.open_store(summary.manifest, settings)
    manifest = json.loads(store.read_bytes(summary.manifest))
    lines: list[dict[str, Any]] = []
    for part in manifest["error_parts"]:
        lines += [json.loads(x) for x in store.read_bytes(part).splitlines() if x.strip()]
    return lines


async def test_an_id_repeated_in_another_shard_is_dead_lettered_not_run_twice(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    rows = [{"id": f"r{i}", "name": f"Shop {i}"} for i in range(30)]
    rows[25]["id"] = "r3"  # shard 1 repeats an id of shard 0
    uri = f"s3://{bucket}/in/repeated.jsonl"
    storage.stores.open_store(uri, workers).put_bytes(
        uri, b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    )
    spec = classify(
        inputs=[uri],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        job_id=f"repeat-{uuid.uuid4().hex[:8]}",
        id_field="id",
        shard_size=20,
        max_concurrent_shards=2,
    )

    summary = await run(temporal_client, workers, spec)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (30, 29, 1)
    out = output_rows(workers, summary)
    assert len(out) == 30 and len({r["item_id"] for r in out}) == 30
    (dead,) = [r for r in out if r["error"] is not None]
    # Whichever shard registered "r3" first keeps it; the other copy dies by position.
    assert dead["item_id"] in ("r3#row-3", "r3#row-25")
    assert dead["error"]["class"] == "InvalidItemId"


async def test_a_shard_that_fails_unread_is_dead_lettered_and_redriven_whole(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    # A real fault, no injector: an input object vanishes between planning and reading.
    first = [{"id": f"a{i}", "name": f"Store {i}"} for i in range(100)]
    second = [{"id": f"b{i}", "name": f"Bakery {i}"} for i in range(30)]
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    a_uri, b_uri = f"s3://{bucket}/in/a.jsonl", f"s3://{bucket}/in/b.jsonl"
    b_data = b"".join(json.dumps(r).encode() + b"\n" for r in second)
    store.put_bytes(a_uri, b"".join(json.dumps(r).encode() + b"\n" for r in first))
    store.put_bytes(b_uri, b_data)
    spec = classify(
        inputs=[a_uri, b_uri],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        job_id=f"vanished-{uuid.uuid4().hex[:8]}",
        id_field="id",
        shard_size=20,
        max_concurrent_shards=1,  # b's shards (5 and 6) start well after planning
        retry={"max_activity_attempts": 2},
    )
    handle, _ = await start_job(temporal_client, spec, settings=workers)
    for _ in range(3000):  # planned within a few seconds
        progress = await handle.query("progress", result_type=JobProgress)
        if progress.shards_total:
            break
        await asyncio.sleep(0.1)
    assert progress.shards_total == 7 and progress.shards_done < 5
    store.delete_prefix(b_uri)

    summary = await asyncio.wait_for(handle.result(), 300)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (130, 100, 30)
    assert summary.failed_shards == [5, 6] and summary.state == "completed_with_errors"
    code, view, err = await dlq(workers, "list", spec.job_id)
    assert code == 0, err
    assert view["by_class"] == {"ShardFailed": 30}
    assert {e["item_id"] for e in view["entries"]} == {f"row-{n}" for n in range(100, 130)}
    assert all("prepare_shard" in e["message"] for e in view["entries"])
    assert view["entries"][0]["source"] == f"{b_uri} (row 1 of 20 in shard 5, never read)"

    # The object is back: re-driving the shard failures reads the real rows, whose own
    # ids replace the placeholders, and every item succeeds.
    store.put_bytes(b_uri, b_data)
    code, result, err = await dlq(workers, "redrive", spec.job_id, "--class", "ShardFailed")
    assert code == 0, err
    assert (result["requeued"], result["succeeded"], result["dead"]) == (30, 30, 0)
    code, view, _ = await dlq(workers, "list", spec.job_id)
    job = JobSummary.model_validate(view["job"])
    assert (view["dead"], job.items_succeeded, job.items_dead) == (0, 130, 0)
    assert (job.state, job.failed_shards) == ("succeeded", [])
    out = output_rows(workers, job)
    assert sorted(r["item_id"] for r in out) == sorted(r["id"] for r in first + second)
    assert error_lines(workers, job) == []
    counts = await ledger_counts(workers, spec.job_id)
    assert (counts.total, counts.succeeded, counts.dead) == (130, 130, 0)
