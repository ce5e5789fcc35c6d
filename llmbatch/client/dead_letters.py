"""Starting a job's DeadLetterWorkflow: the one signal-with-start that the
``report_dead_letters`` activity makes, and the workflow tests' stand-in makes the same
way (it calls this), so the two cannot drift apart."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from llmbatch.contract.dead_letters import DeadLetterInput, ShardDeadLetters
from llmbatch.contract.messages import ShardInput
from llmbatch.contract.names import (
    DEAD_LETTER_WORKFLOW,
    DEAD_LETTERS_SIGNAL,
    dead_letter_workflow_id,
)
from llmbatch.contract.priority import task_priority


async def report_dead_letters(
    client: Client, *, input: ShardInput, report: ShardDeadLetters, task_queue: str
) -> None:
    """Send ``report`` (a shard's dead items) to its job's DeadLetterWorkflow on
    ``task_queue``, starting the workflow if this is the job's first report."""
    job_id = input.spec.job_id
    await client.start_workflow(
        DEAD_LETTER_WORKFLOW,
        DeadLetterInput(
            job_id=job_id,
            spec=input.spec,
            layout=input.layout,
            gpu_task_queue=input.gpu_task_queue,
            generate_schedule_to_start=input.generate_schedule_to_start,
            priority_aging=input.priority_aging,
        ),
        id=dead_letter_workflow_id(job_id),
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=DEAD_LETTERS_SIGNAL,
        start_signal_args=[report],
        static_summary=f"dead letters of {job_id}",
        # Its re-drives run the job's shards: at the job's priority, as its tenant.
        priority=task_priority(input.spec),
    )
