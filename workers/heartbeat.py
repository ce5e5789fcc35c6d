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

HEARTBEAT_EVERY_SECONDS = 5.0


class BackgroundHeartbeatInterceptor(Interceptor):
    """Heartbeat every running activity of the worker every ``every_s`` seconds.

    The heartbeats carry no details: activities that resume from heartbeat details
    (``generate``) heartbeat themselves and do not run on a worker with this.
    """

    def __init__(self, every_s: float = HEARTBEAT_EVERY_SECONDS) -> None:
        self._every_s = every_s

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _HeartbeatingActivity(next, self._every_s)


class _HeartbeatingActivity(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, every_s: float) -> None:
        super().__init__(next)
        self._every_s = every_s

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        if not activity.info().is_local and asyncio.iscoroutinefunction(input.fn):
            beat = asyncio.create_task(self._beat())
            try:
                return await super().execute_activity(input)
            finally:
                beat.cancel()
        return await super().execute_activity(input)

    async def _beat(self) -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(self._every_s)
