"""OpenTelemetry on a real job: one connected trace, and metrics that match the job.

The session's client comes from ``llmbatch.client.temporal.connect``, which installs the
process's providers and Temporal's tracing interceptor; the in-process workers
inherit the interceptor from that client. These tests add an in-memory span
exporter and metric reader to the installed providers for their own duration.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import Client

from llmbatch import telemetry
from llmbatch.config import Settings
from llmbatch.workflows.batch_job import BatchJobWorkflow
from llmbatch.workflows.shard import ShardWorkflow
from tests.fixtures.replay import replayer
from tests.workflows.test_batch_job import classify_on_disk, companies, run

pytestmark = pytest.mark.slow

# Row data that must never show up in a span attribute.
ROW_TEXT = "Medical Labs"
PROMPT_TEXT = "Classify the company"


@pytest.fixture
def spans(workers: Settings) -> Iterator[InMemorySpanExporter]:
    """Every span ended while the test runs (the installed provider has no way to
    remove a processor, so the exporter is shut down afterwards and drops the rest)."""
    installed = telemetry.install()
    assert installed.tracer_provider is not None, "telemetry is off (OTEL_SDK_DISABLED?)"
    exporter = InMemorySpanExporter()
    installed.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.clear()
    exporter.shutdown()


@pytest.fixture
def metric_reader(workers: Settings) -> Iterator[InMemoryMetricReader]:
    installed = telemetry.install()
    assert installed.meter_provider is not None, "telemetry is off (OTEL_SDK_DISABLED?)"
    reader = InMemoryMetricReader()
    installed.meter_provider.add_metric_reader(reader)
    yield reader
    installed.meter_provider.remove_metric_reader(reader)


def _of_job(span: ReadableSpan, job_id: str) -> bool:
    """Spans that say they belong to the job: Temporal's (by workflow id, shards are
    ``<job>/shard-<n>``) and ours (by job id attribute)."""
    attributes = span.attributes or {}
    workflow_id = str(attributes.get("temporalWorkflowID", ""))
    return (
        workflow_id == job_id
        or workflow_id.startswith(f"{job_id}/")
        or attributes.get(telemetry.JOB_ID) == job_id
    )


async def test_one_job_is_one_connected_trace(
    spans: InMemorySpanExporter,
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
) -> None:
    spec = classify_on_disk(tmp_path, companies(45), model_name, shard_size=15)

    summary = await run(temporal_client, workers, spec)

    assert summary.shards_total == 3 and summary.items_succeeded == 45
    finished = list(spans.get_finished_spans())
    roots = [
        s
        for s in finished
        if s.name == "StartWorkflow:BatchJobWorkflow"
        and (s.attributes or {}).get("temporalWorkflowID") == spec.job_id
    ]
    assert len(roots) == 1, [s.name for s in finished]
    root = roots[0]
    assert root.parent is None
    trace_id = root.context.trace_id

    # Every span that names the job is in the root's trace ...
    of_job = [s for s in finished if _of_job(s, spec.job_id)]
    assert {s.context.trace_id for s in of_job} == {trace_id}
    # ... and every span of that trace reaches the root through spans of the trace.
    in_trace = {s.context.span_id: s for s in finished if s.context.trace_id == trace_id}
    for span in in_trace.values():
        chain, current = [span.name], span
        while current.parent is not None:
            parent = in_trace.get(current.parent.span_id)
            assert parent is not None, f"{' <- '.join(chain)}: parent not in the trace"
            chain.append(parent.name)
            current = parent
        assert current is root, " <- ".join(chain)

    names = Counter(s.name for s in in_trace.values())
    shards = summary.shards_total
    # Temporal's spans: the job, its shards (child workflows) and every activity ...
    assert names["RunWorkflow:BatchJobWorkflow"] == 1
    assert names["StartChildWorkflow:ShardWorkflow"] == shards
    assert names["RunWorkflow:ShardWorkflow"] == shards
    for activity in ("prepare_shard", "generate", "write_shard"):
        assert names[f"RunActivity:{activity}"] == shards, activity
    # ... and ours inside the activities: shard I/O and generation.
    assert names["shard.read_input"] == shards
    assert names["generate.read_requests"] == shards
    assert names["generate.engine"] == shards
    assert names["storage.read"] >= 3 * shards and names["storage.write"] >= 3 * shards

    by_name: dict[str, list[ReadableSpan]] = {}
    for span in in_trace.values():
        by_name.setdefault(span.name, []).append(span)
    for span in by_name["generate.engine"]:
        assert in_trace[span.parent.span_id].name == "RunActivity:generate"  # type: ignore[union-attr]
    engine_spans = by_name["generate.engine"]
    assert sum(_int(s, "llmbatch.succeeded") for s in engine_spans) == 45
    assert sorted(_int(s, "llmbatch.shard") for s in engine_spans) == list(range(shards))
    assert sum(_int(s, "llmbatch.rows") for s in by_name["shard.read_input"]) == 45
    assert all(_int(s, "llmbatch.bytes") > 0 for s in by_name["storage.write"])

    # Counts and sizes only: no row data or prompt text in any attribute.
    for span in in_trace.values():
        text = json.dumps(dict(span.attributes or {}), default=str)
        assert ROW_TEXT not in text and PROMPT_TEXT not in text, span.name

    # The job's histories replay with the interceptor in place, and a replay adds
    # no spans (workflow spans are made once, on first execution only).
    workflow_ids = [spec.job_id] + [f"{spec.job_id}/shard-{n:05d}" for n in range(shards)]
    replaying = replayer(
        [BatchJobWorkflow, ShardWorkflow],
        data_converter=temporal_client.data_converter,
        interceptors=[telemetry.tracing_interceptor()],
    )
    before = len(spans.get_finished_spans())
    for workflow_id in workflow_ids:
        history = await temporal_client.get_workflow_handle(workflow_id).fetch_history()
        await replaying.replay_workflow(history)
    assert len(spans.get_finished_spans()) == before


def _int(span: ReadableSpan, key: str) -> int:
    value = (span.attributes or {}).get(key)
    assert isinstance(value, int), (span.name, key, value)
    return value


def _points(reader: InMemoryMetricReader, name: str, job_id: str) -> list[Any]:
    data = reader.get_metrics_data()
    points = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    points += [
                        p
                        for p in metric.data.data_points
                        if (p.attributes or {}).get(telemetry.JOB_ID) == job_id
                    ]
    return points


async def test_item_and_token_counters_equal_the_job_counts(
    metric_reader: InMemoryMetricReader,
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
) -> None:
    rows: list[dict[str, Any]] = companies(40)
    # Dead in prepare_shard's rendering: the template's field is missing.
    for row in rows[3:6]:
        del row["name"]
    # Dead in generate: longer than the test engine's 512-token context.
    for row in rows[20:22]:
        row["name"] = "lab " * 1500
    spec = classify_on_disk(tmp_path, rows, model_name, shard_size=10)

    summary = await run(temporal_client, workers, spec)

    assert (summary.items_succeeded, summary.items_dead) == (35, 5)
    items = {
        p.attributes["llmbatch.status"]: p.value
        for p in _points(metric_reader, "llmbatch.items", spec.job_id)
    }
    assert items == {"succeeded": summary.items_succeeded, "dead": summary.items_dead}
    tokens = {
        p.attributes["llmbatch.token_type"]: p.value
        for p in _points(metric_reader, "llmbatch.tokens", spec.job_id)
    }
    assert tokens == {"prompt": summary.tokens.prompt, "completion": summary.tokens.completion}
    assert all(
        p.attributes[telemetry.MODEL] == model_name
        for p in _points(metric_reader, "llmbatch.items", spec.job_id)
    )
    # One latency per request the engine ran; the too-long prompts never reached it.
    (latency,) = _points(metric_reader, "llmbatch.generation.duration", spec.job_id)
    assert latency.count >= summary.items_succeeded and latency.sum > 0
