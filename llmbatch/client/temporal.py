"""Connecting to Temporal and starting jobs: shared by the CLI, the demo and tests."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, Interceptor, WithStartWorkflowOperation, WorkflowHandle
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from llmbatch.config import Settings
from llmbatch.contract import search_attributes as sa
from llmbatch.contract.messages import ApiBatchRecordInput, BatchJobInput, JobSummary
from llmbatch.contract.names import BATCH_JOB_WORKFLOW, CREATE_API_BATCH_UPDATE
from llmbatch.contract.priority import task_priority
from llmbatch.contract.spec import JobSpec, Task
from llmbatch.errors import LlmBatchError
from llmbatch.security.codec import EncryptionCodec, Keyring, KeyringError, load_keyring
from llmbatch.security.connection import (
    ConnectionConfigError,
    TemporalTarget,
    explain_connect_error,
    temporal_target,
)


class TemporalUnavailable(LlmBatchError, RuntimeError):
    """Temporal cannot be reached, or refused the connection: one line naming the cause."""


def data_converter(keyring: Keyring | None) -> DataConverter:
    """Pydantic JSON, encrypted with ``keyring``'s current key when there is one.

    With a keyring, failure messages and stack traces move into an encoded (so
    encrypted) attribute too: a failure's message may quote what it failed on.
    """
    if keyring is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=EncryptionCodec(keyring),
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def connection(settings: Settings) -> tuple[TemporalTarget, Keyring | None]:
    """Where to connect and the payload keyring, from ``settings`` and Temporal's
    environment configuration; TemporalUnavailable (one line) when they are unusable."""
    try:
        return temporal_target(settings), load_keyring(settings)
    except (ConnectionConfigError, KeyringError) as exc:
        raise TemporalUnavailable(str(exc)) from None


async def connect(settings: Settings, *, tracing: bool = True) -> Client:
    """A client on the configured Temporal, speaking pydantic JSON; the one way every
    llm-batch process (CLI, workers, the embedded stack's checks, ``serve``) connects.

    The address, namespace, TLS, client certificate and API key come from
    :func:`llmbatch.security.connection.temporal_target` (``TEMPORAL_*`` and Temporal's
    TOML profiles, ``LLMBATCH_TEMPORAL_*`` first); payloads are encrypted when a codec
    keyring is configured (:func:`llmbatch.security.codec.load_keyring`).

    OpenTelemetry is set up from the ``OTEL_*`` environment first (once per process),
    and the client carries Temporal's tracing interceptor, which workers built on it
    inherit: a job's client call, workflows and activities make one trace.
    ``tracing=False`` is for calls that only read (``status``, ``watch``): they start
    no trace, and skip loading the OpenTelemetry SDK.
    """
    target, keyring = connection(settings)
    return await connect_to(target, keyring=keyring, tracing=tracing)


async def connect_to(
    target: TemporalTarget, *, keyring: Keyring | None, tracing: bool = True
) -> Client:
    """:func:`connect` once the target is resolved (the embedded stack's own checks
    connect without tracing)."""
    interceptors: list[Interceptor] = []
    if tracing:
        # Here, not at the top: the SDK and Temporal's interceptor (which imports
        # temporalio.worker) are a third of a read-only CLI call's imports.
        from llmbatch import telemetry

        telemetry.install()
        interceptors.append(telemetry.tracing_interceptor())
    try:
        return await Client.connect(
            target.address,
            namespace=target.namespace,
            api_key=target.api_key,
            tls=target.tls,
            rpc_metadata=target.rpc_metadata,
            data_converter=data_converter(keyring),
            interceptors=interceptors,
        )
    except (RuntimeError, RPCError) as exc:
        line = explain_connect_error(exc, target)
        if target.tls is False and "Connection refused" in str(exc):
            line += ". Is the stack up? Try: llm-batch dev up"
        raise TemporalUnavailable(line) from exc


async def start_job(
    client: Client, spec: JobSpec, *, settings: Settings
) -> tuple[WorkflowHandle[object, JobSummary], bool]:
    """Start ``spec`` as a job; return (handle, started).

    The job id is the workflow id: a second start of a running job returns that job
    (``started`` False), and a finished job is never run again under the same id.
    """
    if not spec.job_id:
        # Only a Temporal Schedule starts specs without one (see llmbatch.client.schedules).
        raise ValueError("start_job needs a spec with a job id")
    try:
        handle = await client.start_workflow(
            BATCH_JOB_WORKFLOW, BatchJobInput(spec=spec), **_start_options(spec, settings)
        )
    except WorkflowAlreadyStartedError:
        return client.get_workflow_handle(spec.job_id, result_type=JobSummary), False
    # With USE_EXISTING the server answers started=false when it handed back the
    # running job; the SDK keeps that answer on the handle but has no public accessor.
    response = getattr(handle, "_start_workflow_response", None)
    return handle, bool(getattr(response, "started", True))


def _start_options(spec: JobSpec, settings: Settings) -> dict[str, Any]:
    """How every job's workflow starts (start_job and start_api_batch alike)."""
    return {
        "id": spec.job_id,
        "task_queue": settings.cpu_task_queue,
        "result_type": JobSummary,
        "id_reuse_policy": WorkflowIDReusePolicy.REJECT_DUPLICATE,
        "id_conflict_policy": WorkflowIDConflictPolicy.USE_EXISTING,
        "search_attributes": job_search_attributes(spec),
        "static_summary": f"{spec.job_id}: {spec.model} over {', '.join(spec.inputs)[:200]}",
        # The job's own workflow tasks; its shards and steps are given it too.
        "priority": task_priority(spec),
    }


async def start_api_batch(
    client: Client, spec: JobSpec, record: ApiBatchRecordInput, *, settings: Settings
) -> None:
    """Start an OpenAI Batch API batch's job and have its workflow write the batch's
    record, in one Update-with-Start: Temporal starts the workflow and delivers the
    ``create_api_batch`` update in its first task, so the record exists only with a
    workflow that will end it. Returns once the record is written; raises
    ``WorkflowUpdateFailedError`` when it was refused (its cause says why)."""
    await client.execute_update_with_start_workflow(
        CREATE_API_BATCH_UPDATE,
        record,
        start_workflow_operation=WithStartWorkflowOperation(
            BATCH_JOB_WORKFLOW, BatchJobInput(spec=spec), **_start_options(spec, settings)
        ),
    )


def job_search_attributes(spec: JobSpec) -> TypedSearchAttributes:
    """What a job is found by in the Web UI from its start: its id and model, and its
    priority and tenant when the spec sets them."""
    pairs: list[SearchAttributePair[Any]] = [SearchAttributePair(sa.MODEL, spec.model)]
    if spec.job_id:  # a Schedule's spec has none: each run takes its workflow id
        pairs.insert(0, SearchAttributePair(sa.JOB_ID, spec.job_id))
    if spec.priority is not None:
        pairs.append(SearchAttributePair(sa.JOB_PRIORITY, str(spec.priority)))
    if spec.tenant is not None:
        pairs.append(SearchAttributePair(sa.TENANT, spec.tenant))
    return TypedSearchAttributes(pairs)


async def model_has_worker(
    client: Client,
    settings: Settings,
    model: str,
    *,
    task: Task = Task.GENERATE,
    rpc_timeout: timedelta | None = None,
    endpoint: str | None = None,
) -> bool:
    """Whether a GPU worker polls ``model``'s queue for ``task`` (Temporal's
    DescribeTaskQueue).

    Temporal lists a poller for a few minutes after its last poll, so a worker that
    just stopped still counts: this answers "is anyone serving it", not "is it alive".
    """
    return await queue_has_pollers(
        client, settings.gpu_task_queue(model, task, endpoint=endpoint), rpc_timeout=rpc_timeout
    )


async def queue_has_pollers(
    client: Client, task_queue: str, *, rpc_timeout: timedelta | None = None
) -> bool:
    """Whether a worker polls ``task_queue`` for activities (see :func:`model_has_worker`);
    ``rpc_timeout`` bounds the call (an RPCError DEADLINE_EXCEEDED past it)."""
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        ),
        timeout=rpc_timeout,
    )
    return bool(response.pollers)


async def started_spec(client: Client, job_id: str) -> JobSpec | None:
    """The spec job ``job_id`` runs (or ran) under; None when there is no such job.

    Read from the first event of its latest run's history, the start's own input:
    unlike the ledger's jobs row, which is written once planning is done, it is there
    the moment the job exists, and continue-as-new carries the spec unchanged.
    """
    handle = client.get_workflow_handle(job_id)
    try:
        async for event in handle.fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (started,) = await client.data_converter.decode(payloads, [BatchJobInput])
            assert isinstance(started, BatchJobInput)
            return started.spec
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return None
