"""Connecting to Temporal and starting jobs: shared by the CLI, the demo and tests."""

from __future__ import annotations

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from llmbatch import telemetry
from llmbatch.config import Settings
from llmbatch.contract import search_attributes as sa
from llmbatch.contract.messages import BatchJobInput, JobSummary
from llmbatch.contract.names import BATCH_JOB_WORKFLOW
from llmbatch.contract.spec import JobSpec, Task


class TemporalUnavailable(RuntimeError):
    """Temporal cannot be reached at the configured address."""


async def connect(settings: Settings) -> Client:
    """A client on the configured namespace, speaking pydantic JSON.

    OpenTelemetry is set up from the ``OTEL_*`` environment first (once per process),
    and the client carries Temporal's tracing interceptor, which workers built on it
    inherit: a job's client call, workflows and activities make one trace.
    """
    telemetry.install()
    try:
        return await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            data_converter=pydantic_data_converter,
            interceptors=[telemetry.tracing_interceptor()],
        )
    except (RuntimeError, RPCError) as exc:
        raise TemporalUnavailable(
            f"cannot reach Temporal at {settings.temporal_address} "
            f"(namespace {settings.temporal_namespace}): {exc}. "
            "Is the stack up? Try: llm-batch dev up"
        ) from exc


async def start_job(
    client: Client, spec: JobSpec, *, settings: Settings
) -> tuple[WorkflowHandle[object, JobSummary], bool]:
    """Start ``spec`` as a job; return (handle, started).

    The job id is the workflow id: a second start of a running job returns that job
    (``started`` False), and a finished job is never run again under the same id.
    """
    if not spec.job_id:
        # Only a Temporal Schedule starts specs without one (see llmbatch.schedules).
        raise ValueError("start_job needs a spec with a job id")
    try:
        handle = await client.start_workflow(
            BATCH_JOB_WORKFLOW,
            BatchJobInput(spec=spec),
            id=spec.job_id,
            task_queue=settings.cpu_task_queue,
            result_type=JobSummary,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(sa.JOB_ID, spec.job_id),
                    SearchAttributePair(sa.MODEL, spec.model),
                ]
            ),
            static_summary=f"{spec.job_id}: {spec.model} over {', '.join(spec.inputs)[:200]}",
        )
    except WorkflowAlreadyStartedError:
        return client.get_workflow_handle(spec.job_id, result_type=JobSummary), False
    # With USE_EXISTING the server answers started=false when it handed back the
    # running job; the SDK keeps that answer on the handle but has no public accessor.
    response = getattr(handle, "_start_workflow_response", None)
    return handle, bool(getattr(response, "started", True))


async def model_has_worker(
    client: Client, settings: Settings, model: str, *, task: Task = Task.GENERATE
) -> bool:
    """Whether a GPU worker polls ``model``'s queue for ``task`` (Temporal's
    DescribeTaskQueue).

    Temporal lists a poller for a few minutes after its last poll, so a worker that
    just stopped still counts: this answers "is anyone serving it", not "is it alive".
    """
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=settings.gpu_task_queue(model, task)),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
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
