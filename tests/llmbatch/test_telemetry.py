"""Telemetry set-up from the OTEL_* environment, against real OTLP receivers.

The receivers are small servers on 127.0.0.1 speaking the OTLP protocols (HTTP and
gRPC, with OpenTelemetry's own protobuf and service definitions), so the exporter
packages run exactly as they would against a collector.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from llmbatch import telemetry
from llmbatch.contract.spec import SamplingSpec
from llmbatch.engine.requests import GenerationRequest
from llmbatch.engine.vllm_engine import Engine


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable from the developer's shell leaks into a test."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    return monkeypatch


def test_nothing_is_exported_when_no_endpoint_is_set(otel_env: pytest.MonkeyPatch) -> None:
    assert telemetry.exporter_names("traces") == []
    assert telemetry.exporter_names("metrics") == []


def test_an_endpoint_selects_otlp_over_grpc_unless_the_protocol_says_http(
    otel_env: pytest.MonkeyPatch,
) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert telemetry.exporter_names("traces") == ["otlp_proto_grpc"]
    assert telemetry.exporter_names("metrics") == ["otlp_proto_grpc"]

    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    otel_env.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    assert telemetry.exporter_names("traces") == ["otlp_proto_http"]
    assert telemetry.exporter_names("metrics") == ["otlp_proto_grpc"]


def test_a_signal_endpoint_exports_only_that_signal(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert telemetry.exporter_names("traces") == ["otlp_proto_grpc"]
    assert telemetry.exporter_names("metrics") == []


def test_exporter_variables_win_over_the_endpoint(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    otel_env.setenv("OTEL_METRICS_EXPORTER", "console,otlp")
    assert telemetry.exporter_names("traces") == []
    assert telemetry.exporter_names("metrics") == ["console", "otlp_proto_grpc"]


def test_a_bad_protocol_or_exporter_is_logged_not_raised(
    otel_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    otel_env.setenv("OTEL_METRICS_EXPORTER", "no-such-exporter")
    built = telemetry.build()
    assert built.tracer_provider is not None and built.meter_provider is not None
    built.tracer_provider.shutdown()
    built.meter_provider.shutdown()
    assert "carrier-pigeon" in caplog.text
    assert "no-such-exporter" in caplog.text


def test_sdk_disabled_builds_no_providers(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert telemetry.build() == telemetry.Telemetry(None, None)


class _OtlpHttpReceiver(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that keeps every request body by path."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def http_receiver() -> Iterator[_OtlpHttpReceiver]:
    server = _OtlpHttpReceiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _emit(built: telemetry.Telemetry) -> None:
    """One span and one counter increment through ``built``, flushed out."""
    assert built.tracer_provider is not None and built.meter_provider is not None
    with built.tracer_provider.get_tracer("test").start_as_current_span("a span"):
        pass
    built.meter_provider.get_meter("test").create_counter("test.things").add(3)
    assert built.tracer_provider.force_flush()
    assert built.meter_provider.force_flush()
    built.tracer_provider.shutdown()
    built.meter_provider.shutdown()


def _span_names(requests: list[trace_service_pb2.ExportTraceServiceRequest]) -> list[str]:
    return [
        s.name
        for r in requests
        for rs in r.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]


def _service_names(requests: list[Any]) -> set[str]:
    names = set()
    for request in requests:
        resources = getattr(request, "resource_spans", None) or request.resource_metrics
        for r in resources:
            for a in r.resource.attributes:
                if a.key == "service.name":
                    names.add(a.value.string_value)
    return names


def _counter_total(requests: list[metrics_service_pb2.ExportMetricsServiceRequest]) -> int:
    # Cumulative: each export (flush, then shutdown) carries the total so far.
    return max(
        p.as_int
        for r in requests
        for rm in r.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "test.things"
        for p in m.sum.data_points
    )


def test_spans_and_metrics_reach_an_otlp_http_endpoint(
    otel_env: pytest.MonkeyPatch, http_receiver: _OtlpHttpReceiver
) -> None:
    port = http_receiver.server_address[1]
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")

    _emit(telemetry.build(component="test"))

    traces = [
        trace_service_pb2.ExportTraceServiceRequest.FromString(b)
        for b in http_receiver.bodies["/v1/traces"]
    ]
    metrics = [
        metrics_service_pb2.ExportMetricsServiceRequest.FromString(b)
        for b in http_receiver.bodies["/v1/metrics"]
    ]
    assert _span_names(traces) == ["a span"]
    assert _counter_total(metrics) == 3
    # Without OTEL_SERVICE_NAME the service is llm-batch, not "unknown_service".
    assert _service_names(traces) == _service_names(metrics) == {"llm-batch"}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_spans_and_metrics_reach_an_otlp_grpc_endpoint_by_default(
    otel_env: pytest.MonkeyPatch,
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    traces, metrics = _TraceService(), _MetricsService()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(metrics, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        otel_env.setenv("OTEL_SERVICE_NAME", "gpu-pool-a")
        _emit(telemetry.build())
    finally:
        server.stop(grace=None)
    assert _span_names(traces.requests) == ["a span"]
    assert _counter_total(metrics.requests) == 3
    assert _service_names(traces.requests) == {"gpu-pool-a"}


async def test_engine_queue_gauge_reads_the_requests_the_engine_holds(engine: Engine) -> None:
    installed = telemetry.install()
    assert installed.meter_provider is not None, "telemetry is off (OTEL_SDK_DISABLED?)"
    reader = InMemoryMetricReader()
    installed.meter_provider.add_metric_reader(reader)
    # A regex of exactly 200 letters keeps the request in the engine for 200 steps.
    request = GenerationRequest(
        request_id="gauge-probe",
        prompt="Say something long.",
        sampling=SamplingSpec(regex="[a-z]{200}", max_tokens=256),
    )
    task = asyncio.create_task(engine.generate(request))
    try:
        # Polled: the engine has no event for "request admitted".
        while engine.num_unfinished_requests == 0 and not task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        seen = _gauge(reader, engine.options.model)
    finally:
        result = await task
        installed.meter_provider.remove_metric_reader(reader)
    assert result.error_class is None and len(result.text) == 200
    assert seen is not None and seen >= 1


def _gauge(reader: InMemoryMetricReader, model: str) -> int | None:
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "llmbatch.engine.requests":
                    for p in m.data.data_points:
                        if (
                            isinstance(p, NumberDataPoint)
                            and (p.attributes or {}).get(telemetry.MODEL) == model
                        ):
                            return int(p.value)
    return None


def test_observing_stops_when_asked(otel_env: pytest.MonkeyPatch) -> None:
    installed = telemetry.install()
    assert installed.meter_provider is not None
    reader = InMemoryMetricReader()
    installed.meter_provider.add_metric_reader(reader)
    try:
        stop = telemetry.observe_engine_queue("model-under-test", lambda: 7)
        assert _gauge(reader, "model-under-test") == 7
        stop()
        assert _gauge(reader, "model-under-test") is None
    finally:
        installed.meter_provider.remove_metric_reader(reader)


def test_install_keeps_a_provider_the_application_set_and_runs_once(
    otel_env: pytest.MonkeyPatch,
) -> None:
    # A fresh interpreter: the global providers can be set only once per process.
    script = """
from opentelemetry import metrics, trace
from opentelemetry.sdk.trace import TracerProvider
from llmbatch import telemetry

mine = TracerProvider()
trace.set_tracer_provider(mine)
first = telemetry.install(component="cpu-worker")
assert first.tracer_provider is mine, first
assert first.meter_provider is metrics.get_meter_provider(), "meter provider not installed"
assert telemetry.install() is first
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
