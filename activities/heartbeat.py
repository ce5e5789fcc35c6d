"""How often a running activity heartbeats: a fraction of the heartbeat timeout the
workflow started it with, read from the activity's own info, so the interval
follows the timeout (``workflows/options.py``) instead of being declared twice."""

from __future__ import annotations

from temporalio import activity

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
