"""set_job_paused: carries a job's pause and resume to its running ``generate`` activities.

Activities cannot receive signals, so the pause update of BatchJobWorkflow writes
the flag to the ledger's jobs row here, and ``generate`` reads it from there. A
resume also lifts the Retry-After wait of the job's remote endpoint, in the row and
in every worker of it (:func:`llmbatch.remote.endpoints.lift_job_wait`): whoever
resumes a job wants it to go on now.
"""

from __future__ import annotations

from temporalio import activity

from llmbatch import ledger
from llmbatch.activities.context import ActivityContext
from llmbatch.contract.messages import JobPausedInput
from llmbatch.contract.names import SET_JOB_PAUSED
from llmbatch.remote.endpoints import lift_job_wait


class ControlActivities:
    def __init__(self, ctx: ActivityContext) -> None:
        self._ctx = ctx

    @activity.defn(name=SET_JOB_PAUSED)
    async def set_job_paused(self, input: JobPausedInput) -> bool:
        """Set the job's paused flag; False when the job has no ledger row yet."""
        if not input.paused:
            # First, so that the job's shards, which see the flag within seconds, find
            # the endpoint's wait gone.
            await lift_job_wait(self._ctx.pool, job_id=input.job_id)
        return await ledger.jobs.set_job_paused(
            self._ctx.pool, job_id=input.job_id, paused=input.paused
        )
