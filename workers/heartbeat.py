"""Background heartbeats for a worker's activities, so a dead worker is noticed fast.

Temporal does not watch workers: an activity whose worker was killed is retried only
when one of its timeouts fires. For the CPU steps (read, render, write: seconds of
work, yet given minutes for large shards) that would be the start-to-close timeout.
With this interceptor every running activity heartbeats every few seconds while the
worker's event loop runs, so the workflow can give the step a short heartbeat timeout
and a killed worker's step moves to another worker within that timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from llmbatch.activities.heartbeat import BEATS_PER_TIMEOUT, heartbeat_interval
from llmbatch.workflows.options import HEARTBEAT_TIMEOUT

# Every worker's ``max_heartbeat_throttle_interval``. The SDK sends an activity's
# heartbeats at most once per throttle interval, by default 0.8 of its heartbeat
# timeout (24 of 30 s): the beats the activities give every 5 s were held back, and
# one heartbeat call Temporal was slow to answer (13-16 s, seen on a loaded machine)
# timed a healthy step out, charging its items an attempt. Capped at the activities'
# own interval, each beat reaches Temporal and one slow call fits in the timeout.
HEARTBEAT_THROTTLE = HEARTBEAT_TIMEOUT / BEATS_PER_TIMEOUT


class BackgroundHeartbeatInterceptor(Interceptor):
    """Heartbeat every running activity of the worker, several times per its
    heartbeat timeout.

    The heartbeats carry no details: activities that resume from heartbeat details
    (``generate``) heartbeat themselves and do not run on a worker with this.
    """

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _HeartbeatingActivity(next)


class _HeartbeatingActivity(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        if not activity.info().is_local and asyncio.iscoroutinefunction(input.fn):
            beat = asyncio.create_task(self._beat())
            try:
                return await super().execute_activity(input)
            finally:
                beat.cancel()
        return await super().execute_activity(input)

    async def _beat(self) -> None:
        every_s = heartbeat_interval()
        while True:
            activity.heartbeat()
            await asyncio.sleep(every_s)
