"""Heartbeats reach Temporal as often as activities give them (a real dev server).

The SDK holds an activity's heartbeats back to one per 0.8 of its heartbeat timeout
unless the worker caps the throttle. Held back, one heartbeat call that Temporal was
slow to answer (13-16 s on a loaded machine) timed out a healthy generate step and
charged its items an attempt. Every llm-batch worker caps it at
``HEARTBEAT_THROTTLE``; this shows what the cap does on a real server.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import Worker

from llmbatch.activities.heartbeat import heartbeat_interval
from llmbatch.workers.heartbeat import HEARTBEAT_THROTTLE
from llmbatch.workflows.options import HEARTBEAT_TIMEOUT

RUN_S = 14.0

# When each run's activity began beating (by workflow id): the test counts RUN_S from
# there, not from the start of the workflow, which a loaded machine can delay by 10 s.
BEGAN: dict[str, asyncio.Event] = {}


@activity.defn(name="beat_for_a_while")
async def beat_for_a_while() -> None:
    # As generate's heartbeat loop does: a beat every heartbeat_interval().
    loop = asyncio.get_running_loop()
    workflow_id = activity.info().workflow_id
    assert workflow_id is not None  # run by BeatForAWhile
    BEGAN[workflow_id].set()
    until = loop.time() + RUN_S + 20  # still beating when the test looks, however slow
    while loop.time() < until:
        activity.heartbeat()
        await asyncio.sleep(heartbeat_interval())


@workflow.defn(name="BeatForAWhile", sandboxed=False)
class BeatForAWhile:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(
            beat_for_a_while,
            start_to_close_timeout=timedelta(minutes=2),
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )


async def _last_heartbeat_age(client: Client, throttle: timedelta | None) -> float:
    """Seconds since Temporal recorded the activity's last beat, RUN_S after its first."""
    queue = f"heartbeat-throttle-{uuid.uuid4().hex[:8]}"
    options = {} if throttle is None else {"max_heartbeat_throttle_interval": throttle}
    async with Worker(
        client,
        task_queue=queue,
        workflows=[BeatForAWhile],
        activities=[beat_for_a_while],
        **options,  # type: ignore[arg-type]
    ):
        began = BEGAN[queue] = asyncio.Event()
        handle = await client.start_workflow(
            BeatForAWhile.run, id=queue, task_queue=queue, execution_timeout=timedelta(minutes=2)
        )
        await asyncio.wait_for(began.wait(), timeout=60)
        await asyncio.sleep(RUN_S)
        pending = (await handle.describe()).raw_description.pending_activities
        await handle.terminate()
    assert len(pending) == 1
    last = pending[0].last_heartbeat_time.ToDatetime(tzinfo=UTC)
    return (datetime.now(UTC) - last).total_seconds()


async def test_capped_throttle_sends_every_beat(temporal_client: Client) -> None:
    # Beats every 5 s: the last one Temporal has is at most a beat (plus slack) old.
    age = await _last_heartbeat_age(temporal_client, HEARTBEAT_THROTTLE)
    assert age < HEARTBEAT_THROTTLE.total_seconds() + 3, age


async def test_the_sdks_default_throttle_holds_beats_back(temporal_client: Client) -> None:
    # Without the cap the first beat is the last Temporal has until 24 s: the defect.
    age = await _last_heartbeat_age(temporal_client, None)
    assert age > RUN_S - 4, age
