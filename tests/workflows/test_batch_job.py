"""Jobs end to end on the real stack: Temporal dev server, Postgres, SeaweedFS, vLLM CPU."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from llmbatch import formats, ledger, storage
from llmbatch.cli._support.progress import Snapshot
from llmbatch.client.temporal import start_job
from llmbatch.config import Settings
from llmbatch.contract import search_attributes
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.spec import ChatMessage, JobSpec, OutputFormat, SamplingSpec
from llmbatch.contract.states import FailureType
from llmbatch.workflows.batch_job import BatchJobWorkflow
from llmbatch.workflows.shard import ShardWorkflow
from tests.fixtures.replay import replayer

pytestmark = pytest.mark.slow

LABELS = ["Healthcare", "Retail", "Technology", "Other"]
JOB_TIMEOUT_S = 300


def job_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def classify(*, inputs: list[str], output_uri: str, model: str, **overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "job_id": job_id("classify"),
        "inputs": inputs,
        "messages": [
            ChatMessage(role="system", content="Classify the company."),
            ChatMessage(role="user", content="Company: {{ name }}"),
        ],
        "model": model,
        "sampling": SamplingSpec(choice=LABELS, max_tokens=8),
        "output_uri": output_uri,
        "shard_size": 50,
    }
    values.update(overrides)
    return JobSpec(**values)


def classify_on_disk(
    tmp_path: Path, rows: list[dict[str, Any]], model: str, **overrides: Any
) -> JobSpec:
    """A classify job over ``rows``, written as JSONL under ``tmp_path/in``; its
    output goes under ``tmp_path/out``."""
    source = tmp_path / "in" / "companies.jsonl"
    source.parent.mkdir()
    source.write_bytes(jsonl_bytes(rows))
    return classify(
        inputs=[str(source)], output_uri=f"file://{tmp_path / 'out'}", model=model, **overrides
    )


async def run(client: Client, settings: Settings, spec: JobSpec) -> JobSummary:
    handle, started = await start_job(client, spec, settings=settings)
    assert started
    return await asyncio.wait_for(handle.result(), JOB_TIMEOUT_S)


def output_rows(settings: Settings, summary: JobSummary) -> list[dict[str, Any]]:
    store = storage.stores.open_store(summary.manifest, settings)
    manifest = json.loads(store.read_bytes(summary.manifest))
    rows: list[dict[str, Any]] = []
    for part in manifest["output_parts"]:
        data = store.read_bytes(part)
        reader = (
            formats.read_parquet_bytes if part.endswith(".parquet") else formats.read_jsonl_bytes
        )
        rows.extend(reader(data))
    return rows


def companies(n: int) -> list[dict[str, Any]]:
    return [{"id": f"c{i:05d}", "name": f"Company {i} Medical Labs", "n": i} for i in range(n)]


def csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue().encode()


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


async def ledger_counts(settings: Settings, job: str) -> ledger.jobs.JobCounts:
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        return await ledger.jobs.job_counts(pool, job_id=job)
    finally:
        await pool.close()


async def test_csv_from_s3_every_item_once_and_choices_hold(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    rows = companies(230)
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/companies.csv", csv_bytes(rows))
    spec = classify(
        inputs=[f"s3://{bucket}/in/*.csv"],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        id_field="id",
    )

    summary = await run(temporal_client, workers, spec)

    assert summary.state == "succeeded"
    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (230, 230, 0)
    assert summary.shards_total == 5
    out = output_rows(workers, summary)
    assert sorted(r["item_id"] for r in out) == [r["id"] for r in rows]
    assert all(r["text"] in LABELS and r["error"] is None for r in out)
    assert all(r["input"]["name"] == f"Company {r['input']['n']} Medical Labs" for r in out)
    assert summary.tokens.completion > 0
    counts = await ledger_counts(workers, spec.job_id)
    assert (counts.total, counts.succeeded, counts.dead) == (230, 230, 0)
    # What an operator sees in the Web UI: filterable counts and a details line.
    handle = temporal_client.get_workflow_handle(spec.job_id)
    attrs = (await handle.describe()).typed_search_attributes
    assert attrs.get(search_attributes.ITEMS_DONE) == 230
    assert attrs.get(search_attributes.ITEMS_TOTAL) == 230
    assert attrs.get(search_attributes.ITEMS_DEAD) == 0
    assert attrs.get(search_attributes.JOB_ID) == spec.job_id
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert "items 230/230 done" in metadata.current_details


async def test_a_csv_whose_field_names_have_spaces_is_read_through_row(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    """The customers file of the seeds names its fields ``First Name``, ``Customer Id``."""
    rows = [
        {"Customer Id": f"C-{i}", "First Name": f"Ann {i}", "Company": "Cedar"} for i in range(7)
    ]
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/customers.csv", csv_bytes(rows))
    spec = classify(
        inputs=[f"s3://{bucket}/in/customers.csv"],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        id_field="Customer Id",
        messages=[ChatMessage(role="user", content='{{ row["First Name"] }} at {{ Company }}')],
    )

    summary = await run(temporal_client, workers, spec)

    assert (summary.state, summary.items_succeeded, summary.items_dead) == ("succeeded", 7, 0)
    out = output_rows(workers, summary)
    assert sorted(r["item_id"] for r in out) == sorted(r["Customer Id"] for r in rows)


async def test_jsonl_from_disk_more_shards_than_window_parquet_out(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    spec = classify_on_disk(
        tmp_path,
        companies(120),
        model_name,
        shard_size=10,
        max_concurrent_shards=3,
        output_format=OutputFormat.PARQUET,
    )

    summary = await run(temporal_client, workers, spec)

    assert summary.shards_total == 12 and summary.shards_done == 12
    out = output_rows(workers, summary)
    # Without an id field, the item id is the row's position in the input.
    assert sorted(r["item_id"] for r in out) == sorted(f"row-{i}" for i in range(120))
    assert {r["text"] for r in out} <= set(LABELS)
    assert len(list((tmp_path / "out" / spec.job_id).glob("part-*.parquet"))) == 12


async def test_parquet_from_s3_with_json_schema_yields_parsed_objects(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    rows = companies(40)
    table = pa.Table.from_pylist(rows)
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=15)
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/companies.parquet", buffer.getvalue())
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["a", "b"]}},
        "required": ["label"],
        "additionalProperties": False,
    }
    spec = classify(
        inputs=[f"s3://{bucket}/in/companies.parquet"],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        id_field="id",
        sampling=SamplingSpec(json_schema=schema, max_tokens=32),
    )

    summary = await run(temporal_client, workers, spec)

    out = output_rows(workers, summary)
    assert len(out) == 40
    ok = [r for r in out if r["error"] is None]
    # The tiny model's random weights may run out of tokens mid-object; those rows
    # are dead-lettered as InvalidStructuredOutput, every other one parses.
    assert all(r["parsed"]["label"] in ("a", "b") for r in ok)
    assert all(r["error"]["class"] == "InvalidStructuredOutput" for r in out if r["error"])
    assert summary.items_succeeded + summary.items_dead == 40
    assert summary.items_succeeded > 0


async def test_openai_batch_file_gives_openai_output_and_error_file(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    lines: list[dict[str, Any]] = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model_name,
                "messages": [{"role": "user", "content": f"Say hello {i}"}],
                "max_tokens": 5,
            },
        }
        for i in range(30)
    ]
    lines[7]["url"] = "/v1/embeddings"  # cannot run: goes to the error file
    lines[9]["body"]["model"] = "gpt-4o-mini"  # another model: never run on the job's
    data = jsonl_bytes(lines) + b"{not json\n"
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/batch.jsonl", data)
    spec = JobSpec(
        job_id=job_id("openai"),
        inputs=[f"s3://{bucket}/in/batch.jsonl"],
        model=model_name,
        output_uri=f"s3://{bucket}/out",
        shard_size=8,
    )

    summary = await run(temporal_client, workers, spec)

    assert (summary.items_total, summary.items_succeeded, summary.items_dead) == (31, 28, 3)
    manifest = json.loads(store.read_bytes(summary.manifest))
    outputs = [
        json.loads(line)
        for part in manifest["output_parts"]
        for line in store.read_bytes(part).splitlines()
    ]
    errors = [
        json.loads(line)
        for part in manifest["error_parts"]
        for line in store.read_bytes(part).splitlines()
    ]
    assert sorted(o["custom_id"] for o in outputs) == sorted(
        f"req-{i}" for i in range(30) if i not in (7, 9)
    )
    for o in outputs:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 5
        assert isinstance(body["choices"][0]["message"]["content"], str)
    codes = {e["custom_id"]: e["error"]["code"] for e in errors}
    assert codes == {"req-7": "InvalidRequest", "req-9": "InvalidRequest", "row-30": "InvalidRow"}
    (wrong_model,) = [e["error"]["message"] for e in errors if e["custom_id"] == "req-9"]
    assert "'gpt-4o-mini'" in wrong_model and repr(model_name) in wrong_model


async def test_same_job_id_twice_is_one_job_with_one_set_of_results(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/c.csv", csv_bytes(companies(60)))
    spec = classify(
        inputs=[f"s3://{bucket}/in/c.csv"], output_uri=f"s3://{bucket}/out", model=model_name
    )

    first, started_first = await start_job(temporal_client, spec, settings=workers)
    second, started_second = await start_job(temporal_client, spec, settings=workers)

    assert (started_first, started_second) == (True, False)
    assert first.result_run_id == second.result_run_id
    summary = await asyncio.wait_for(first.result(), JOB_TIMEOUT_S)
    # Once finished, a third start is refused and hands back the finished job.
    third, started_third = await start_job(temporal_client, spec, settings=workers)
    assert not started_third
    assert (await third.result()).items_succeeded == 60
    assert len(output_rows(workers, summary)) == 60
    counts = await ledger_counts(workers, spec.job_id)
    assert counts.total == 60 and counts.succeeded == 60


async def test_bad_jobs_are_refused_with_a_clear_message(
    workers: Settings, temporal_client: Client, bucket: str, model_name: str
) -> None:
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/c.csv", csv_bytes(companies(3)))

    missing = classify(
        inputs=[f"s3://{bucket}/nope/*.csv"], output_uri=f"s3://{bucket}/out", model=model_name
    )
    handle, _ = await start_job(temporal_client, missing, settings=workers)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), 60)
    assert f"s3://{bucket}/nope/*.csv" in str(failure.value.cause)

    unknown_field = classify(
        inputs=[f"s3://{bucket}/in/c.csv"],
        output_uri=f"s3://{bucket}/out",
        model=model_name,
        messages=[ChatMessage(role="user", content="{{ name }} in {{ city }}")],
    )
    handle, _ = await start_job(temporal_client, unknown_field, settings=workers)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), 60)
    message = str(failure.value.cause)
    assert "city" in message and "id, n, name" in message


async def failure_of(client: Client, settings: Settings, spec: JobSpec) -> ApplicationError:
    """The failure of a job that is expected to fail."""
    handle, _ = await start_job(client, spec, settings=settings)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), 60)
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError)
    return cause


async def test_jobs_started_directly_touch_no_file_outside_the_local_roots(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    # Started over Temporal, as another service would, so no CLI check runs first:
    # plan_job refuses. The session's roots are its basetemp and the project folder.
    output = f"file://{tmp_path / 'out'}"
    host_file = classify(
        inputs=["/etc/os-release"], output_uri=output, model=model_name, input_format="csv"
    )
    cause = await failure_of(temporal_client, workers, host_file)
    assert cause.type == FailureType.INVALID_JOB_SPEC
    assert "/etc/os-release" in cause.message and "LLMBATCH_LOCAL_ROOTS" in cause.message
    assert "NAME=" not in cause.message

    link = tmp_path / "companies.csv"
    link.symlink_to("/etc/os-release")
    linked = classify(inputs=[str(link)], output_uri=output, model=model_name)
    cause = await failure_of(temporal_client, workers, linked)
    assert cause.type == FailureType.INVALID_JOB_SPEC and "LLMBATCH_LOCAL_ROOTS" in cause.message

    data = tmp_path / "in.csv"
    data.write_bytes(csv_bytes(companies(3)))
    outside = classify(inputs=[str(data)], output_uri="file:///var/tmp/llm-out", model=model_name)
    cause = await failure_of(temporal_client, workers, outside)
    assert cause.type == FailureType.INVALID_JOB_SPEC and "/var/tmp/llm-out" in cause.message
    for path in (Path("/var/tmp/llm-out"), tmp_path / "out"):
        assert not await asyncio.to_thread(path.exists)


async def test_output_to_a_missing_bucket_fails_and_creates_no_bucket(
    workers: Settings, temporal_client: Client, bucket: str, s3_client: Any, model_name: str
) -> None:
    store = storage.stores.open_store(f"s3://{bucket}/x", workers)
    store.put_bytes(f"s3://{bucket}/in/c.csv", csv_bytes(companies(3)))
    missing = f"{bucket}-missing"
    spec = classify(
        inputs=[f"s3://{bucket}/in/c.csv"], output_uri=f"s3://{missing}/out", model=model_name
    )
    cause = await failure_of(temporal_client, workers, spec)
    assert cause.type == FailureType.INVALID_JOB_SPEC
    assert f"bucket '{missing}' does not exist" in cause.message
    assert missing not in [b["Name"] for b in s3_client.list_buckets()["Buckets"]]


async def test_histories_replay_without_nondeterminism(
    workers: Settings, temporal_client: Client
) -> None:
    histories = []
    async for execution in temporal_client.list_workflows(
        "WorkflowType = 'BatchJobWorkflow' OR WorkflowType = 'ShardWorkflow'", limit=20
    ):
        histories.append(await temporal_client.get_workflow_handle(execution.id).fetch_history())
    assert histories, "the other tests in this module should have left histories"
    replaying = replayer(
        [BatchJobWorkflow, ShardWorkflow],
        data_converter=temporal_client.data_converter,
    )
    for history in histories:
        await replaying.replay_workflow(history)


async def test_status_counts_items_as_they_are_recorded_not_when_their_shard_ends(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    """What `status` (and `watch`) read moves while a shard runs: the recorder writes
    results about once a second, and the counts take them from the ledger then, not
    only when the shard reports to its job."""
    from llmbatch.cli._support.jobview import describe_job, follow_job

    shard = 48
    # Answers of staggered lengths (vLLM's ignore_eos: each runs to its max_tokens), so
    # they come back over several of the recorder's flushes, one shard at a time.
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model_name,
                "messages": [{"role": "user", "content": f"Count to {i}"}],
                "max_tokens": 10 * (i % shard + 1),
                "ignore_eos": True,
            },
        }
        for i in range(2 * shard)
    ]
    source = tmp_path / "batch.jsonl"
    source.write_bytes(jsonl_bytes(lines))
    spec = JobSpec(
        job_id=job_id("live"),
        inputs=[str(source)],
        model=model_name,
        output_uri=f"file://{tmp_path / 'out'}",
        shard_size=shard,
        max_concurrent_shards=1,
    )
    handle, _ = await start_job(temporal_client, spec, settings=workers)
    # What `watch` shows, followed alongside.
    watched = _Recording()
    result = asyncio.ensure_future(
        follow_job(temporal_client, handle, settings=workers, quiet=False, view=watched)
    )
    # items_succeeded as status read it, while the first shard had not ended.
    before_first_shard: list[int] = []
    try:
        while not result.done():
            _, progress = await describe_job(temporal_client, workers, spec.job_id)
            if progress.shards_done:
                break
            before_first_shard.append(progress.items_succeeded)
            await asyncio.sleep(0.2)
        summary = await asyncio.wait_for(result, JOB_TIMEOUT_S)
    finally:
        result.cancel()
    assert (summary.items_succeeded, summary.items_dead) == (2 * shard, 0)
    assert any(0 < n < shard for n in before_first_shard), before_first_shard
    # Never backwards.
    assert before_first_shard == sorted(before_first_shard)
    shown = [(p.shards_done, p.items_succeeded) for p in watched.readings]
    assert any(done == 0 and 0 < n < shard for done, n in shown), shown
    assert any(done == 1 and shard < n < 2 * shard for done, n in shown), shown


class _Recording:
    """A progress view that keeps every reading `watch` would show."""

    def __init__(self) -> None:
        self.readings: list[JobProgress] = []

    def __enter__(self) -> _Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None:
        self.readings.append(snapshot.progress)
