"""How often a running activity heartbeats: a fraction of the heartbeat timeout the
workflow started it with, read from the activity's own info, so the interval
follows the timeout (``workflows/options.py``) instead of being declared twice; and
the activity as the stages see it (:class:`~llmbatch.stages.context.Step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity

from llmbatch.stages.context import Step

# Several beats fit in one timeout, so one lost or late beat never times out a step.
BEATS_PER_TIMEOUT = 6
# Without a heartbeat timeout nobody waits for the beats; they still carry cancels.
DEFAULT_INTERVAL_S = 5.0


def heartbeat_interval() -> float:
    """Seconds between heartbeats of the current activity."""
    timeout = activity.info().heartbeat_timeout
    if not timeout:
        return DEFAULT_INTERVAL_S
    return max(timeout.total_seconds() / BEATS_PER_TIMEOUT, 0.1)


def step(*, details: Callable[[], Any] | None = None) -> Step:
    """The current activity as a stage sees it: its heartbeat (with what ``details``
    gives at each beat), and its heartbeat timeout."""
    timeout = activity.info().heartbeat_timeout
    return Step(
        beat=activity.heartbeat if details is None else lambda: activity.heartbeat(details()),
        heartbeat_timeout_s=timeout.total_seconds() if timeout else None,
    )
