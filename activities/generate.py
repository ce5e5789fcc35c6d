"""generate: run a shard's requests through the worker's engine.

Runs on the GPU queue. Results go to the ledger in batches, fenced by this
attempt's lease, so a retried attempt picks up exactly what is not done yet and a
stale attempt (one that outlived its heartbeat timeout) cannot overwrite it.

An adapter over the generate stage (:class:`llmbatch.stages.generate.Attempt`, which
records through :mod:`llmbatch.stages.record`): this module keeps what is Temporal's,
the attempt's identity and progress from the activity's info, its heartbeats, the
model check, and how the attempt's end is reported (cancelled, refused by an
endpoint, engine dead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmbatch.activities.context import ActivityContext
from llmbatch.activities.heartbeat import heartbeat_interval, step
from llmbatch.contract.messages import GenerateProgress, GenerateResult, ShardInput
from llmbatch.contract.names import GENERATE, model_identity
from llmbatch.contract.spec import Task
from llmbatch.contract.states import FailureType
from llmbatch.engine.base import BatchEngine
from llmbatch.engine.errors import EndpointRefusedError, engine_dead
from llmbatch.stages.drain import Drain
from llmbatch.stages.generate import Attempt


class GenerateActivities:
    def __init__(
        self,
        ctx: ActivityContext,
        engine: BatchEngine,
        *,
        max_in_flight: int,
        on_engine_dead: Callable[[BaseException], None] | None = None,
        task: Task = Task.GENERATE,
        drain: Drain | None = None,
    ) -> None:
        self._ctx = ctx
        # Shared by the worker's activities; without one, a worker shutdown aborts at
        # once (a drain timeout of 0), as Temporal's default graceful timeout has it.
        self._drain = drain or Drain(timeout=timedelta(0))
        self._engine = engine
        self._max_in_flight = max_in_flight
        self._on_engine_dead = on_engine_dead
        # The task the engine was built for: an embed worker's engine is vLLM's pooling
        # runner, and the same activity loop drives it (see EmbedRecorder).
        self._task = task

    @activity.defn(name=GENERATE)
    async def generate(self, input: ShardInput) -> GenerateResult:
        """Generate every request of the shard that the ledger does not have yet."""
        info = activity.info()
        progress = (
            GenerateProgress.model_validate(info.heartbeat_details[0])
            if info.heartbeat_details
            else GenerateProgress()
        )
        self._check_model(input)
        attempt = Attempt(
            self._ctx,
            input,
            self._engine,
            holder=f"{info.workflow_id}/{info.activity_id}",
            attempt=info.attempt,
            progress=progress,
            step=step(details=progress.model_dump),
            drain=self._drain,
            max_in_flight=self._max_in_flight,
            embed=self._task is Task.EMBED,
        )
        await attempt.claim()
        heartbeat = asyncio.create_task(_heartbeat_loop(progress, renew=attempt.leads.renew))
        try:
            await attempt.run()
        except asyncio.CancelledError:
            await asyncio.shield(attempt.cancelled())
            raise
        except EndpointRefusedError as exc:
            # Let Temporal retry this attempt, which waits while the job is paused.
            await asyncio.shield(attempt.refused(exc))
            raise ApplicationError(
                f"{exc}; job {input.spec.job_id} paused", type=FailureType.ENDPOINT_REFUSED
            ) from None
        except Exception as exc:
            if engine_dead(exc) and self._on_engine_dead is not None:
                self._on_engine_dead(exc)
            raise
        finally:
            heartbeat.cancel()
            attempt.end_span()
        activity.heartbeat(progress.model_dump())
        return attempt.result()

    def _check_model(self, input: ShardInput) -> None:
        """Refuse a shard for another model than the one loaded, before touching any
        item: queue names are derived from the model, but anything can start an
        activity on any queue, and a job must never run on a model it did not name."""
        served = self._engine.model
        if input.spec.task is not self._task:
            raise ApplicationError(
                f"{FailureType.WRONG_MODEL}: job {input.spec.job_id} is a {input.spec.task} "
                f"job, but this worker (task queue {activity.info().task_queue}) serves "
                f"{self._task} with {served}",
                type=FailureType.WRONG_MODEL,
                non_retryable=True,
            )
        if model_identity(input.spec.model) != model_identity(served):
            raise ApplicationError(
                f"{FailureType.WRONG_MODEL}: job {input.spec.job_id} names model "
                f"{input.spec.model}, but this worker (task queue "
                f"{activity.info().task_queue}) serves {served}",
                type=FailureType.WRONG_MODEL,
                non_retryable=True,
            )


async def _heartbeat_loop(
    progress: GenerateProgress, *, renew: Callable[[], Awaitable[None]] | None = None
) -> None:
    # Heartbeats carry cancellation to us and tell Temporal we are alive even while
    # the engine is busy with long generations; ``renew`` tells other shards the same.
    every_s = heartbeat_interval()
    while True:
        activity.heartbeat(progress.model_dump())
        if renew is not None:
            await renew()
        await asyncio.sleep(every_s)
