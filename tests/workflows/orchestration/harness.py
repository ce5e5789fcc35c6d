"""One job's world for an orchestration test: workers with the stand-ins, and helpers.

Each run has its own task queues and job id, so tests sharing a dev server never see
each other's workers or workflows. The real workflows run in the default (sandboxed)
workflow runner, so a sandbox import problem fails these tests too.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from llmbatch.contract.messages import (
    ApiBatchRecordInput,
    BatchJobInput,
    JobSummary,
    ShardSummary,
)
from llmbatch.contract.names import (
    BATCH_JOB_WORKFLOW,
    CREATE_API_BATCH_UPDATE,
    dead_letter_workflow_id,
    redrive_shard_workflow_id,
    shard_workflow_id,
)
from llmbatch.contract.spec import ApiBatch, ApiEndpoint, ChatMessage, InputFormat, JobSpec
from llmbatch.workflows.batch_job import BatchJobWorkflow
from llmbatch.workflows.dead_letter import DeadLetterWorkflow
from llmbatch.workflows.shard import ShardWorkflow
from tests.workflows.orchestration.stand_ins import GUARD_S, StandIns

# Heartbeats go out at once, so a cancel reaches a waiting stand-in at once (the
# workflows' 30 s heartbeat timeout would otherwise throttle them to 24 s).
HEARTBEAT_THROTTLE = timedelta(milliseconds=20)

ResultT = TypeVar("ResultT")


@dataclass
class Run:
    """A job's id, its task queues, its stand-ins, and the client to drive it with."""

    client: Client
    job_id: str
    task_queue: str
    stand_ins: StandIns

    def spec(
        self, *, max_concurrent_shards: int, api_window_s: int | None = None, **fields: Any
    ) -> JobSpec:
        """A job's spec; with ``api_window_s``, an OpenAI Batch API batch's with that
        completion window. ``fields`` sets other JobSpec fields (priority, tenant, ...)."""
        if api_window_s is not None:
            return JobSpec(
                job_id=self.job_id,
                inputs=["s3://stand-in/api/files/file-in"],
                input_format=InputFormat.OPENAI,
                model="stand-in-model",
                max_concurrent_shards=max_concurrent_shards,
                output_uri="s3://stand-in/api/batches",
                api_batch=ApiBatch(
                    project="p",
                    endpoint=ApiEndpoint.CHAT_COMPLETIONS,
                    completion_window_s=api_window_s,
                ),
                **fields,
            )
        return JobSpec(
            job_id=self.job_id,
            inputs=["s3://stand-in/rows.jsonl"],
            messages=[ChatMessage(role="user", content="{{ text }}")],
            model="stand-in-model",
            max_concurrent_shards=max_concurrent_shards,
            output_uri="s3://stand-in/out",
            **fields,
        )

    async def start_job(
        self, *, max_concurrent_shards: int, api_window_s: int | None = None, **fields: Any
    ) -> WorkflowHandle[Any, JobSummary]:
        """Start the job as a bare client would: no search attributes, no priority."""
        spec = self.spec(
            max_concurrent_shards=max_concurrent_shards, api_window_s=api_window_s, **fields
        )
        if spec.api_batch is None:
            return await self.client.start_workflow(
                BATCH_JOB_WORKFLOW,
                BatchJobInput(spec=spec),
                id=self.job_id,
                task_queue=self.task_queue,
                result_type=JobSummary,
            )
        # An API batch starts with its record, in one Update-with-Start, as the server
        # starts it (llmbatch.client.start_api_batch).
        start: WithStartWorkflowOperation[Any, JobSummary] = WithStartWorkflowOperation(
            BATCH_JOB_WORKFLOW,
            BatchJobInput(spec=spec),
            id=self.job_id,
            task_queue=self.task_queue,
            result_type=JobSummary,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
        record = ApiBatchRecordInput(
            batch_id=self.job_id,
            project=spec.api_batch.project,
            input_file_id="file-in",
            endpoint=spec.api_batch.endpoint,
            completion_window="24h",
            window_s=spec.api_batch.completion_window_s,
            model=spec.model,
            max_in_progress=100,
        )
        await self.client.execute_update_with_start_workflow(
            CREATE_API_BATCH_UPDATE, record, start_workflow_operation=start
        )
        return await start.workflow_handle()

    def shard(self, shard: int) -> WorkflowHandle[Any, ShardSummary]:
        """The job's own run of ``shard``."""
        return self.client.get_workflow_handle(
            shard_workflow_id(self.job_id, shard), result_type=ShardSummary
        )

    def dead_letters(self) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(dead_letter_workflow_id(self.job_id))

    async def status(self, workflow_id: str, run_id: str | None = None) -> WorkflowExecutionStatus:
        description = await self.client.get_workflow_handle(workflow_id, run_id=run_id).describe()
        assert description.status is not None
        return description.status

    async def exists(self, workflow_id: str) -> bool:
        try:
            await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def has_event(self, workflow_id: str, event_type: EventType.ValueType) -> bool:
        history = await self.client.get_workflow_handle(workflow_id).fetch_history()
        return any(e.event_type == event_type for e in history.events)

    async def terminate_leftovers(self) -> None:
        """Terminate what a test left running (dead-letter lists, held shards)."""
        shards = range(self.stand_ins.shards)
        ids = [
            self.job_id,
            dead_letter_workflow_id(self.job_id),
            *(shard_workflow_id(self.job_id, s) for s in shards),
            *(redrive_shard_workflow_id(self.job_id, 1, s) for s in shards),
        ]
        for workflow_id in ids:
            with contextlib.suppress(RPCError):
                await self.client.get_workflow_handle(workflow_id).terminate("test over")


@contextlib.asynccontextmanager
async def orchestrate(
    client: Client,
    *,
    shards: int,
    dead: Mapping[int, int] | None = None,
    redrive_dead: Mapping[int, int] | None = None,
    failures: Iterable[tuple[str, int]] = (),
    ignore_cancel: Iterable[tuple[str, int]] = (),
    invalid_batch: bool = False,
    progress_every: timedelta | None = None,
) -> AsyncIterator[Run]:
    """A CPU worker (the three workflows and every stand-in but generate) and a GPU
    worker (the generate stand-in, on the queue plan_job names) for one job."""
    name = f"orch-{uuid.uuid4().hex[:12]}"
    stand_ins = StandIns(
        shards=shards,
        gpu_task_queue=f"{name}-gpu",
        dead=dead,
        redrive_dead=redrive_dead,
        failures=failures,
        ignore_cancel=ignore_cancel,
        invalid_batch=invalid_batch,
        progress_every=progress_every,
    )
    run = Run(client=client, job_id=name, task_queue=f"{name}-cpu", stand_ins=stand_ins)
    cpu = Worker(
        client,
        task_queue=run.task_queue,
        workflows=[BatchJobWorkflow, ShardWorkflow, DeadLetterWorkflow],
        activities=stand_ins.activities(),
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
    )
    gpu = Worker(
        client,
        task_queue=stand_ins.gpu_task_queue,
        activities=[stand_ins.generate],
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
    )
    async with cpu, gpu:
        try:
            yield run
        finally:
            await run.terminate_leftovers()


async def result_of(handle: WorkflowHandle[Any, ResultT]) -> ResultT:
    """The workflow's result (following continue-as-new), guarded against a hang."""
    return await asyncio.wait_for(handle.result(), GUARD_S)
