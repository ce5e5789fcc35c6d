"""When an endpoint's failures stop a job: the limits (from the settings) and each
remote worker's count of them per job.

Sending again is right for a blip (a server restart, a proxy's error page, a 429) and
wrong for a fault that lasts (a wrong base URL, an HTML page answered with 200 to
every request): sent again for ever, a job pays for each unusable answer and says
nothing. So a job is paused, as a refused key pauses it, when

- its requests got :attr:`FaultPolicy.max_unusable_answers` unusable answers in a row
  (a 2xx that is not an answer: each may be paid for), or
- none of its requests got any answer for :attr:`FaultPolicy.pause_after_failing_s`
  (refused or dropped connections, unknown host, timeouts, 5xx), counted from the
  first failure since the last answer.

An HTTP answer the item is to blame for (a 400) shows the endpoint works, as a
good answer does; a 429 shows it is there (its wait is capped by
:attr:`FaultPolicy.max_retry_after_s` instead). The counts are per worker process
and job, in memory; an ``endpoint update`` or a ``resume`` clears them (the
endpoint's generation changes). Nothing here does I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmbatch.contract.states import EndpointFault

# Faults that say nothing answered (the endpoint may be away for good).
UNANSWERED = frozenset(
    {
        EndpointFault.UNREACHABLE,
        EndpointFault.TIMEOUT,
        EndpointFault.CONNECTION_DROPPED,
        EndpointFault.SERVER_ERROR,
    }
)
# Jobs tracked at most (a worker serves many jobs over its life; the oldest go).
MAX_TRACKED_JOBS = 10_000


@dataclass(frozen=True, slots=True)
class FaultPolicy:
    """The settings ``remote_max_retry_after_s``, ``remote_max_unusable_answers`` and
    ``remote_pause_after_failing_s`` (:class:`llmbatch.config.Settings`), in seconds."""

    max_retry_after_s: float = 300.0
    max_unusable_answers: int = 20
    pause_after_failing_s: float = 300.0  # 0: never

    def capped_wait(self, asked_s: float) -> float:
        return min(asked_s, self.max_retry_after_s)


@dataclass(slots=True)
class _Streak:
    unusable: int = 0
    failing_since: float | None = None  # monotonic: first unanswered request since an answer
    seen: float = 0.0


class JobFaults:
    """One worker's counts of each job's failing requests to one endpoint."""

    def __init__(self, endpoint: str, policy: FaultPolicy) -> None:
        self._endpoint = endpoint
        self.policy = policy
        self._jobs: dict[str, _Streak] = {}

    def answered(self, job_id: str) -> None:
        """A usable answer, or one the item is to blame for: the endpoint works."""
        self._jobs.pop(job_id, None)

    def failed(self, job_id: str, fault: EndpointFault, message: str) -> str | None:
        """A failed request of ``job_id``; returns why the job must pause now, or None."""
        now = time.monotonic()
        streak = self._jobs.get(job_id)
        if streak is None:
            if len(self._jobs) >= MAX_TRACKED_JOBS:
                oldest = min(self._jobs, key=lambda j: self._jobs[j].seen)
                del self._jobs[oldest]
            streak = self._jobs[job_id] = _Streak()
        streak.seen = now
        policy = self.policy
        if fault is EndpointFault.UNUSABLE_ANSWER:
            streak.unusable += 1
            streak.failing_since = None  # something answered
            if streak.unusable >= policy.max_unusable_answers:
                return (
                    f"endpoint {self._endpoint} gave {streak.unusable} unusable answers in a "
                    f"row (at most LLMBATCH_REMOTE_MAX_UNUSABLE_ANSWERS="
                    f"{policy.max_unusable_answers}): {fault}: {message}"
                )
        elif fault in UNANSWERED:
            if streak.failing_since is None:
                streak.failing_since = now
            failing = now - streak.failing_since
            if policy.pause_after_failing_s and failing >= policy.pause_after_failing_s:
                return (
                    f"endpoint {self._endpoint} gave no answer for {failing:.0f} s (at most "
                    f"LLMBATCH_REMOTE_PAUSE_AFTER_FAILING_S={policy.pause_after_failing_s:g} s): "
                    f"{fault}: {message}"
                )
        else:  # throttled or refused: the endpoint is there
            streak.failing_since = None
        return None

    def clear(self) -> None:
        """The endpoint was changed or a job resumed: every count starts again."""
        self._jobs.clear()
