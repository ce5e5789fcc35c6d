"""OpenTelemetry: traces and metrics, configured by the standard ``OTEL_*`` variables.

:func:`install` sets the process's tracer and meter providers once, from the
environment; :func:`llmbatch.client.temporal.connect` calls it, so the CLI, the workers and
anything else that talks to Temporal through llm-batch is covered. The SDK and the
exporter packages read their own settings (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_*`` endpoint, headers, timeout,
certificates and compression, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_METRIC_EXPORT_INTERVAL`` ...). This module decides only *which* exporters
run, as the SDK's own auto-configuration does, with one difference: when
``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` is unset, OTLP is used only
where an OTLP endpoint is set, so nothing is exported (and nothing retries against
a collector that is not there) unless someone said where to send it.

Temporal's :class:`~temporalio.contrib.opentelemetry.TracingInterceptor` carries the
trace from the client's ``StartWorkflow`` span through the workflows (it makes their
spans outside the sandbox, so workflow code never imports OpenTelemetry) into every
activity; :func:`span` adds the service's own spans inside activities, and
:func:`metrics` its instruments. Attributes are counts, sizes, shard numbers, the
job id and the model: never row data, prompts or item ids.

In one module on purpose: every instrument is declared here once, beside the
exporter set-up that reports it (the metrics reference is generated from this module).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

# The API's placeholder until a meter provider is set (no public name for it).
from opentelemetry.metrics._internal import _ProxyMeterProvider
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_SDK_DISABLED,
)
from opentelemetry.util.types import AttributeValue

# The SDK (and psutil, which its resources import) and Temporal's tracing interceptor
# (which imports temporalio.worker) load where providers or interceptors are made: a
# read-only CLI call that imports this module for its names never needs them.
if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor
    from temporalio.worker import Interceptor as WorkerInterceptor

__all__ = [
    "INSTRUMENTS",
    "Instrument",
    "Metrics",
    "Telemetry",
    "annotate",
    "attrs",
    "build",
    "install",
    "metrics",
    "observe_endpoint",
    "observe_engine_queue",
    "span",
    "tracing_interceptor",
    "worker_interceptors",
]

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "llm-batch"
INSTRUMENTATION_NAME = "llmbatch"

# Attribute keys. Bounded cardinality: a job id and a model, never an item id.
JOB_ID = "llmbatch.job_id"
MODEL = "llmbatch.model"
SHARD = "llmbatch.shard"
COMPONENT = "llmbatch.component"
ENDPOINT = "llmbatch.endpoint"

Signal = Literal["traces", "metrics"]

# Per signal: the exporter choice, its protocol and endpoint variables, and the
# entry point group exporter packages register under (the SDK's own names).
_EXPORTER_ENV: dict[Signal, str] = {
    "traces": OTEL_TRACES_EXPORTER,
    "metrics": OTEL_METRICS_EXPORTER,
}
_PROTOCOL_ENV: dict[Signal, str] = {
    "traces": OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    "metrics": OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
}
_ENDPOINT_ENV: dict[Signal, str] = {
    "traces": OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    "metrics": OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
}
_ENTRY_POINT_GROUP: dict[Signal, str] = {
    "traces": "opentelemetry_traces_exporter",
    "metrics": "opentelemetry_metrics_exporter",
}
# The Python SDK's default OTLP protocol is gRPC (port 4317); http/protobuf uses 4318.
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
_DEFAULT_OTLP_PROTOCOL = "grpc"

# Generation latency buckets in seconds: a short classification takes tens of
# milliseconds, a long generation on a busy engine minutes.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


@dataclass(frozen=True)
class Telemetry:
    """The SDK providers in use, or ``None`` where telemetry is off.

    Tests add an in-memory span processor or metric reader to these; a provider the
    application set up before llm-batch did is used as it is (and returned here when
    it is an SDK provider).
    """

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED=true``: no providers, every span and metric a no-op."""
    return os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true"


def exporter_names(signal: Signal) -> list[str]:
    """The exporter entry point names for ``signal`` that the environment asks for.

    ``OTEL_<SIGNAL>_EXPORTER`` is a comma-separated list (``otlp``, ``console``,
    ``none``, or any installed exporter's entry point name). Unset means OTLP when an
    OTLP endpoint is set for the signal, nothing otherwise. ``otlp`` resolves to gRPC
    or HTTP by ``OTEL_EXPORTER_OTLP_[<SIGNAL>_]PROTOCOL``, as in the SDK.
    """
    raw = os.environ.get(_EXPORTER_ENV[signal])
    if raw is None or not raw.strip():
        endpoint = os.environ.get(_ENDPOINT_ENV[signal]) or os.environ.get(
            OTEL_EXPORTER_OTLP_ENDPOINT
        )
        names = ["otlp"] if endpoint else []
    else:
        names = [n.strip() for n in raw.split(",") if n.strip()]
    if "none" in names:
        return []
    return [_resolve_otlp(name, signal) for name in names]


def _resolve_otlp(name: str, signal: Signal) -> str:
    if name != "otlp":
        return name
    protocol = (
        os.environ.get(_PROTOCOL_ENV[signal])
        or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL)
        or _DEFAULT_OTLP_PROTOCOL
    ).strip()
    if protocol not in _OTLP_BY_PROTOCOL:
        raise ValueError(
            f"unsupported OTLP protocol {protocol!r}; use one of {sorted(_OTLP_BY_PROTOCOL)}"
        )
    return _OTLP_BY_PROTOCOL[protocol]


def _exporters(signal: Signal) -> list[Any]:
    """Exporter instances for ``signal``; each reads its own ``OTEL_*`` settings.

    A misconfigured exporter is logged and left out: telemetry must never stop a
    worker or a submit.
    """
    exporters: list[Any] = []
    try:
        names = exporter_names(signal)
    except ValueError as exc:
        log.warning("OpenTelemetry %s not exported: %s", signal, exc)
        return exporters
    for name in names:
        found = list(entry_points(group=_ENTRY_POINT_GROUP[signal], name=name))
        if not found:
            log.warning(
                "OpenTelemetry %s exporter %r is not installed; %s not exported there",
                signal,
                name,
                signal,
            )
            continue
        try:
            exporters.append(found[0].load()())
        except Exception as exc:  # a bad endpoint, header or certificate setting
            log.warning("OpenTelemetry %s exporter %r failed to start: %s", signal, name, exc)
    return exporters


def _resource(component: str | None) -> Resource:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; our name
    # is only the fallback for the SDK's "unknown_service".
    resource = Resource.create({COMPONENT: component} if component else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def build(*, component: str | None = None) -> Telemetry:
    """New tracer and meter providers from the environment (not installed globally)."""
    if sdk_disabled():
        return Telemetry(None, None)
    resource = _resource(component)
    return Telemetry(_tracer_provider(resource), _meter_provider(resource))


def _tracer_provider(resource: Resource) -> TracerProvider:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    provider = TracerProvider(resource=resource)
    for exporter in _exporters("traces"):
        if isinstance(exporter, SpanExporter):
            provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meter_provider(resource: Resource) -> MeterProvider:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )

    readers: list[MetricReader] = []
    for exporter in _exporters("metrics"):
        if isinstance(exporter, MetricReader):  # pull exporters (Prometheus)
            readers.append(exporter)
        elif isinstance(exporter, MetricExporter):
            readers.append(PeriodicExportingMetricReader(exporter))
    return MeterProvider(metric_readers=readers, resource=resource)


_installed: Telemetry | None = None
_install_lock = threading.Lock()


def install(*, component: str | None = None) -> Telemetry:
    """Set the process's tracer and meter providers from the environment, once.

    OpenTelemetry allows one global provider of each kind per process, so later
    calls return what the first one installed (``component`` then has no effect).
    Providers the application installed first are kept.
    """
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = _install(component)
        return _installed


def _install(component: str | None) -> Telemetry:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    if sdk_disabled():
        return Telemetry(None, None)
    resource = _resource(component)
    tracer_provider = _existing(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    if tracer_provider is None:
        tracer_provider = _tracer_provider(resource)
        trace.set_tracer_provider(tracer_provider)
    meter_provider = _existing(otel_metrics.get_meter_provider(), _ProxyMeterProvider)
    if meter_provider is None:
        meter_provider = _meter_provider(resource)
        otel_metrics.set_meter_provider(meter_provider)
    return Telemetry(
        tracer_provider if isinstance(tracer_provider, TracerProvider) else None,
        meter_provider if isinstance(meter_provider, MeterProvider) else None,
    )


def _existing(provider: Any, proxy: type) -> Any:
    """``provider`` if the application installed one, None if it is the API's proxy."""
    return None if isinstance(provider, proxy) else provider


# --- Temporal ---------------------------------------------------------------


def tracing_interceptor() -> TracingInterceptor:
    """Temporal's tracing interceptor on the global tracer provider.

    Put it on the client: workers built on that client take it from there. Workflow
    spans are only made under a client's span (``always_create_workflow_spans`` off):
    a workflow started without trace context would otherwise make one orphan trace
    per activity once it is replayed.
    """
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return TracingInterceptor()


def worker_interceptors(client: Client) -> list[WorkerInterceptor]:
    """The tracing interceptor for a worker on ``client``, unless the client already
    carries one (the worker inherits it; both would record every span twice)."""
    from temporalio.contrib.opentelemetry import TracingInterceptor

    if any(isinstance(i, TracingInterceptor) for i in client.config()["interceptors"]):
        return []
    return [tracing_interceptor()]


# --- spans ------------------------------------------------------------------


def tracer() -> trace.Tracer:
    """llm-batch's tracer (through the global provider, so it may be made early)."""
    return trace.get_tracer(INSTRUMENTATION_NAME)


@contextlib.contextmanager
def span(name: str, **attributes: AttributeValue | None) -> Iterator[trace.Span]:
    """A span under the current one; keyword attributes are prefixed ``llmbatch.``.

    ``None`` values are left out. Set result counts on the yielded span as they
    become known (``span.set_attribute``).
    """
    with tracer().start_as_current_span(name, attributes=attrs(**attributes)) as current:
        yield current


def annotate(**attributes: AttributeValue | None) -> None:
    """Set ``llmbatch.``-prefixed attributes on the current span (an activity's
    ``RunActivity`` span, say); nothing when no span is recording."""
    trace.get_current_span().set_attributes(attrs(**attributes))


def attrs(**values: AttributeValue | None) -> dict[str, AttributeValue]:
    """``llmbatch.``-prefixed attributes from keyword values, without the ``None`` ones."""
    return {f"llmbatch.{k}": v for k, v in values.items() if v is not None}


# --- metrics ----------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """llm-batch's instruments. Attributes: ``llmbatch.job_id``, ``llmbatch.model``,
    plus ``llmbatch.status`` (items) or ``llmbatch.token_type`` (tokens)."""

    items: Counter
    tokens: Counter
    generation_duration: Histogram
    engine_requests: Counter
    gpu_seconds: Counter
    endpoint_requests: Counter
    endpoint_retries: Counter
    endpoint_wait: Counter
    endpoint_cost: Counter

    def count_endpoint_request(
        self, *, endpoint: str, job_id: str, throttled: bool, rate_wait_s: float, server_s: float
    ) -> None:
        """One request answered by a remote endpoint (``throttled``: with 429/503), the
        time it waited for the rate budget before and the time it took at the server."""
        base = {ENDPOINT: endpoint, JOB_ID: job_id}
        self.endpoint_requests.add(
            1, {**base, "llmbatch.outcome": "throttled" if throttled else "answered"}
        )
        if rate_wait_s:
            self.endpoint_wait.add(rate_wait_s, {**base, "llmbatch.waited_for": "rate"})
        self.endpoint_wait.add(server_s, {**base, "llmbatch.waited_for": "server"})

    def count_items(
        self, n: int, *, job_id: str, model: str, status: str, source: str | None = None
    ) -> None:
        """``n`` items reached ``status`` (``succeeded`` or ``dead``) in the ledger;
        succeeded ones say how (``generated``, ``deduplicated``, ``cached``)."""
        if n:
            attributes = {JOB_ID: job_id, MODEL: model, "llmbatch.status": status}
            if source is not None:
                attributes["llmbatch.result_source"] = source
            self.items.add(n, attributes)

    def count_tokens(
        self, *, prompt: int, completion: int, job_id: str, model: str, reused: bool = False
    ) -> None:
        """Tokens of succeeded items; ``reused`` ones were not generated by this job's
        engine work (deduplicated or cached results)."""
        base = {JOB_ID: job_id, MODEL: model, "llmbatch.token_origin": _origin(reused)}
        if prompt:
            self.tokens.add(prompt, {**base, "llmbatch.token_type": "prompt"})
        if completion:
            self.tokens.add(completion, {**base, "llmbatch.token_type": "completion"})


def _origin(reused: bool) -> str:
    return "reused" if reused else "generated"


@dataclass(frozen=True)
class Instrument:
    """One instrument's definition: what :func:`metrics` and :func:`observe_engine_queue`
    create, and what the generated metrics reference (``llm-batch docs generate``) lists."""

    name: str
    kind: Literal["counter", "histogram", "gauge"]
    unit: str
    description: str
    attributes: tuple[str, ...]


ITEMS = Instrument(
    "llmbatch.items",
    "counter",
    "{item}",
    "Items that reached a final state in the ledger, by status.",
    (JOB_ID, MODEL, "llmbatch.status", "llmbatch.result_source"),
)
TOKENS = Instrument(
    "llmbatch.tokens",
    "counter",
    "{token}",
    "Prompt and completion tokens of succeeded items.",
    (JOB_ID, MODEL, "llmbatch.token_type", "llmbatch.token_origin"),
)
GENERATION_DURATION = Instrument(
    "llmbatch.generation.duration",
    "histogram",
    "s",
    "Time from submitting a request to the engine to its final output.",
    (JOB_ID, MODEL),
)
ENGINE_SUBMITTED = Instrument(
    "llmbatch.engine.submitted",
    "counter",
    "{request}",
    "Requests submitted to the vLLM engine (deduplicated and cached items never are).",
    (MODEL,),
)
GPU_SECONDS = Instrument(
    "llmbatch.gpu.seconds",
    "counter",
    "s",
    "Engine busy time on a job's shards, times the engine's GPUs.",
    (JOB_ID, MODEL),
)
ENGINE_REQUESTS = Instrument(
    "llmbatch.engine.requests",
    "gauge",
    "{request}",
    "Requests in the vLLM engine, running or waiting to be scheduled.",
    (MODEL,),
)
# The engine queues' backlog, exported by the CPU worker (llmbatch.client.queues).
TASK_QUEUE, TASK = "llmbatch.task_queue", "llmbatch.task"
QUEUE_BACKLOG = Instrument(
    "llmbatch.queue.backlog",
    "gauge",
    "{task}",
    "Activity tasks waiting on an engine task queue (Temporal's approximate count).",
    (TASK_QUEUE, MODEL, TASK),
)
QUEUE_BACKLOG_AGE = Instrument(
    "llmbatch.queue.backlog_age",
    "gauge",
    "s",
    "Age of the oldest activity task waiting on an engine task queue.",
    (TASK_QUEUE, MODEL, TASK),
)
QUEUE_POLLERS = Instrument(
    "llmbatch.queue.pollers",
    "gauge",
    "{worker}",
    "Workers Temporal saw polling an engine task queue lately.",
    (TASK_QUEUE, MODEL, TASK),
)
QUEUE_UNFINISHED = Instrument(
    "llmbatch.queue.unfinished_items",
    "gauge",
    "{item}",
    "Unfinished items of running jobs for an engine queue's model and task (the ledger).",
    (TASK_QUEUE, MODEL, TASK),
)
QUEUE_INSTRUMENTS = (QUEUE_BACKLOG, QUEUE_BACKLOG_AGE, QUEUE_POLLERS, QUEUE_UNFINISHED)
# Remote endpoints (llmbatch.remote), counted by the remote worker.
ENDPOINT_REQUESTS = Instrument(
    "llmbatch.endpoint.requests",
    "counter",
    "{request}",
    "Requests a remote endpoint answered, by outcome (answered, or throttled: 429/503).",
    (ENDPOINT, JOB_ID, "llmbatch.outcome"),
)
ENDPOINT_RETRIES = Instrument(
    "llmbatch.endpoint.retries",
    "counter",
    "{request}",
    "Requests sent to a remote endpoint again (after a 429, a 5xx, a timeout).",
    (ENDPOINT, JOB_ID),
)
ENDPOINT_WAIT = Instrument(
    "llmbatch.endpoint.wait",
    "counter",
    "s",
    "Request-seconds spent waiting for the endpoint's shared rate budget (and backing "
    "off after a 429: rate) or on the server (server); more rate than server: the job "
    "is rate-bound.",
    (ENDPOINT, JOB_ID, "llmbatch.waited_for"),
)
ENDPOINT_COST = Instrument(
    "llmbatch.endpoint.cost",
    "counter",
    "USD",
    "Cost of the tokens a remote endpoint answered, at its declared prices.",
    (ENDPOINT, JOB_ID),
)
ENDPOINT_SEND_FACTOR = Instrument(
    "llmbatch.endpoint.send_factor",
    "gauge",
    "1",
    "Share of its RPM/TPM limits an endpoint is sent at now, for every worker (halved "
    "on a 429, raised again each second), as this worker last leased it.",
    (ENDPOINT,),
)
ENDPOINT_INSTRUMENTS = (
    ENDPOINT_REQUESTS,
    ENDPOINT_RETRIES,
    ENDPOINT_WAIT,
    ENDPOINT_COST,
    ENDPOINT_SEND_FACTOR,
)
#: Every instrument llm-batch reports, in the order the reference lists them.
INSTRUMENTS: tuple[Instrument, ...] = (
    ITEMS,
    TOKENS,
    GENERATION_DURATION,
    ENGINE_SUBMITTED,
    GPU_SECONDS,
    ENGINE_REQUESTS,
    *QUEUE_INSTRUMENTS,
    *ENDPOINT_INSTRUMENTS,
)


@functools.cache
def metrics() -> Metrics:
    """The instruments, made once (through the global provider's proxy, so calling
    this before :func:`install` is fine)."""
    meter = otel_metrics.get_meter(INSTRUMENTATION_NAME)

    def counter(spec: Instrument) -> Counter:
        return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

    return Metrics(
        items=counter(ITEMS),
        tokens=counter(TOKENS),
        generation_duration=meter.create_histogram(
            GENERATION_DURATION.name,
            unit=GENERATION_DURATION.unit,
            description=GENERATION_DURATION.description,
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        ),
        engine_requests=counter(ENGINE_SUBMITTED),
        gpu_seconds=counter(GPU_SECONDS),
        endpoint_requests=counter(ENDPOINT_REQUESTS),
        endpoint_retries=counter(ENDPOINT_RETRIES),
        endpoint_wait=counter(ENDPOINT_WAIT),
        endpoint_cost=counter(ENDPOINT_COST),
    )


# Gauges read on each metric collection: per instrument, the live sources (their
# attributes and how to read them), registered and dropped by their owners.
_gauges: dict[str, dict[int, tuple[dict[str, AttributeValue], Callable[[], float]]]] = {}
_gauges_lock = threading.Lock()


def _observe(
    spec: Instrument, attributes: dict[str, AttributeValue], read: Callable[[], float]
) -> Callable[[], None]:
    """Report ``read()`` as ``spec``'s gauge with ``attributes`` until the returned
    function is called."""
    key = id(read)
    with _gauges_lock:
        sources = _gauges.get(spec.name)
        if sources is None:
            sources = _gauges[spec.name] = {}
            otel_metrics.get_meter(INSTRUMENTATION_NAME).create_observable_gauge(
                spec.name,
                callbacks=[functools.partial(_read_gauge, spec.name)],
                unit=spec.unit,
                description=spec.description,
            )
        sources[key] = (attributes, read)

    def stop() -> None:
        with _gauges_lock:
            _gauges[spec.name].pop(key, None)

    return stop


def observe_engine_queue(model: str, depth: Callable[[], int]) -> Callable[[], None]:
    """Report ``depth()`` (requests the engine holds: running or waiting in its
    scheduler) as the ``llmbatch.engine.requests`` gauge until the returned function
    is called. Read on each metric collection, not per request."""
    return _observe(ENGINE_REQUESTS, {MODEL: model}, depth)


def observe_endpoint(endpoint: str, send_factor: Callable[[], float]) -> Callable[[], None]:
    """Report ``send_factor()`` as the endpoint's ``llmbatch.endpoint.send_factor``."""
    return _observe(ENDPOINT_SEND_FACTOR, {ENDPOINT: endpoint}, send_factor)


def _read_gauge(name: str, options: CallbackOptions) -> Iterable[Observation]:
    with _gauges_lock:
        sources = list(_gauges.get(name, {}).values())
    observations = []
    for attributes, read in sources:
        try:
            observations.append(Observation(read(), attributes))
        except Exception:  # an engine shutting down; the next collection skips it
            log.debug("gauge %s not read", name, exc_info=True)
    return observations
