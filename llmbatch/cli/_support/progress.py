"""Live progress of a job in the CLI (``watch``, ``submit --wait``).

Progress comes from BatchJobWorkflow's ``progress`` query, polled about once a second,
with what the running shards have recorded so far read from the ledger (items move as
they are recorded, not when their shard ends); rates come from successive samples.
Three views of the same samples: a rich bar when stdout is a terminal, a plain line
every few seconds when it is not (logs, CI, pipes), and JSON Lines for programs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Protocol, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from temporalio.client import (
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError

from llmbatch.cli._support.common import DEFAULT_LINE_INTERVAL_S, emit_json_line
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import PROGRESS_QUERY
from llmbatch.contract.progress import format_duration
from llmbatch.contract.states import JobState

log = logging.getLogger(__name__)

# Rates are measured over this much of the recent past: long enough to smooth the
# recorder's batches (items are recorded about once a second), short enough to follow
# a job that speeds up or slows down.
RATE_WINDOW_S = 60.0
POLL_EVERY_S = 1.0
QUERY_TIMEOUT = timedelta(seconds=10)


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float  # time.monotonic()
    items: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One progress reading with the rates derived from the readings before it."""

    progress: JobProgress
    items_per_s: float
    tokens_per_s: float
    eta_s: float | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON Lines record of this reading."""
        p = self.progress
        return {
            "type": "progress",
            "job_id": p.job_id,
            "state": p.state,
            "paused": p.paused,
            "shards_total": p.shards_total,
            "shards_done": p.shards_done,
            "shards_running": len(p.shards_running),
            "items_total": p.items_total,
            "items_done": p.items_done,
            "items_succeeded": p.items_succeeded,
            "items_dead": p.items_dead,
            "tokens_prompt": p.tokens.prompt,
            "tokens_completion": p.tokens.completion,
            "items_per_s": round(self.items_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
        }

    def line(self) -> str:
        """The plain one-line form, for output that is not a terminal."""
        p = self.progress
        share = f" ({100 * p.items_done // p.items_total}%)" if p.items_total else ""
        eta = f", ETA {format_duration(self.eta_s)}" if self.eta_s is not None else ""
        return (
            f"{datetime.now():%H:%M:%S} {p.job_id} {p.state}: "
            f"{p.items_done}/{p.items_total} items{share}, {p.items_dead} dead, "
            f"shards {p.shards_done}/{p.shards_total}, "
            f"{self.items_per_s:.1f} items/s, {self.tokens_per_s:.0f} tokens/s{eta}"
        )


class Rates:
    """Items/s and tokens/s from successive samples, and the time left at that pace.

    The rate is the change over the samples of the last RATE_WINDOW_S seconds. Until
    that change is positive (just after the watch starts, or a job whose counts move
    only when a shard finishes) it falls back to the average since the job started.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[_Sample] = deque()

    def add(self, progress: JobProgress, *, at: float | None = None) -> Snapshot:
        """Record a reading taken at ``at`` (monotonic seconds; default now)."""
        now = time.monotonic() if at is None else at
        tokens = progress.tokens.prompt + progress.tokens.completion
        self._samples.append(_Sample(now, progress.items_done, tokens))
        while len(self._samples) > 2 and now - self._samples[1].at >= self._window_s:
            self._samples.popleft()
        first, last = self._samples[0], self._samples[-1]
        span = last.at - first.at
        if span > 0 and last.items > first.items:
            items_per_s = (last.items - first.items) / span
            tokens_per_s = (last.tokens - first.tokens) / span
        else:
            elapsed = _since(progress.started_at)
            items_per_s = progress.items_done / elapsed if elapsed else 0.0
            tokens_per_s = tokens / elapsed if elapsed else 0.0
        left = progress.items_total - progress.items_done
        eta = left / items_per_s if items_per_s > 0 and left > 0 else None
        if progress.state not in (JobState.RUNNING, JobState.PAUSED) or progress.paused:
            eta = None  # no pace to finish at while paused, nothing left once ended
        return Snapshot(progress, items_per_s, tokens_per_s, eta)


def _since(started_at: str | None) -> float:
    if started_at is None:
        return 0.0
    return max((datetime.now(UTC) - datetime.fromisoformat(started_at)).total_seconds(), 0.0)


class ProgressView(Protocol):
    """Where snapshots go; a context manager around the whole follow."""

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None: ...


class _ViewBase:
    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


class BarView(_ViewBase):
    """A live rich progress bar, redrawn in place (a terminal only)."""

    def __init__(self, console: Console) -> None:
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "{task.fields[items_per_s]:.1f} items/s  {task.fields[tokens_per_s]:.0f} tok/s  "
                "dead {task.fields[dead]}  ETA {task.fields[eta]}"
            ),
            console=console,
            transient=False,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> Self:
        self._bar.start()
        self._task = self._bar.add_task(
            "planning", total=None, items_per_s=0.0, tokens_per_s=0.0, dead=0, eta="-"
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.stop()

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None:
        assert self._task is not None, "use the view as a context manager"
        p = snapshot.progress
        self._bar.update(
            self._task,
            description=f"{p.job_id} {p.state}",
            total=p.items_total or None,
            completed=p.items_done,
            items_per_s=snapshot.items_per_s,
            tokens_per_s=snapshot.tokens_per_s,
            dead=p.items_dead,
            eta=format_duration(snapshot.eta_s),
        )


class LineView(_ViewBase):
    """A plain line at most every ``interval_s`` seconds, and whenever the state changes
    (running, paused, ...), for logs and pipes where a redrawn bar would be noise."""

    def __init__(self, console: Console, *, interval_s: float = DEFAULT_LINE_INTERVAL_S) -> None:
        self._console = console
        self._interval_s = interval_s
        self._last_at = float("-inf")
        self._last_state: str | None = None

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None:
        now = time.monotonic()
        state = snapshot.progress.state
        if final or state != self._last_state or now - self._last_at >= self._interval_s:
            self._last_at, self._last_state = now, state
            self._console.print(snapshot.line(), markup=False, highlight=False)
            self._console.file.flush()


class JsonLinesView(_ViewBase):
    """One JSON object per reading on stdout, at most every ``interval_s`` seconds."""

    def __init__(self, *, interval_s: float = DEFAULT_LINE_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._last_at = float("-inf")
        self._last_state: str | None = None

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None:
        now = time.monotonic()
        state = snapshot.progress.state
        if final or state != self._last_state or now - self._last_at >= self._interval_s:
            self._last_at, self._last_state = now, state
            emit_json_line(snapshot.as_dict())


class QuietView(_ViewBase):
    """Shows nothing (``submit --wait --json`` prints only the summary)."""

    def show(self, snapshot: Snapshot, *, final: bool = False) -> None:
        return None


def choose_view(
    console: Console, *, as_json: bool, interval_s: float = DEFAULT_LINE_INTERVAL_S
) -> ProgressView:
    """JSON Lines for ``--json``; a bar when ``console`` is a terminal; lines otherwise."""
    if as_json:
        return JsonLinesView(interval_s=interval_s)
    if console.is_terminal:
        return BarView(console)
    return LineView(console, interval_s=interval_s)


# Reads what a running job's shards have recorded into its progress (the ledger's
# counts: jobview.RecordedProgress).
Recorded = Callable[[JobProgress], Awaitable[JobProgress]]


async def follow(
    handle: WorkflowHandle[Any, JobSummary],
    view: ProgressView,
    *,
    poll_s: float = POLL_EVERY_S,
    recorded: Recorded | None = None,
) -> JobSummary:
    """Show the job's progress in ``view`` until it ends; return its summary.

    ``recorded`` adds to each reading what the running shards have recorded so far
    (without it, items count when their shard ends). Raises what ``handle.result()``
    raises when the job fails or is cancelled.
    """
    result = asyncio.ensure_future(handle.result())
    rates = Rates()
    try:
        with view:
            while not result.done():
                progress = await _read_progress(handle)
                if progress is not None and recorded is not None:
                    progress = await _with_recorded(recorded, progress)
                if progress is not None and not result.done():
                    view.show(rates.add(progress))
                await asyncio.wait([result], timeout=poll_s)
            if result.exception() is None:
                view.show(rates.add(result.result()), final=True)
    finally:
        if not result.done():
            result.cancel()  # interrupted (Ctrl-C): stop waiting; the job goes on
    return result.result()


async def _with_recorded(recorded: Recorded, progress: JobProgress) -> JobProgress:
    try:
        return await recorded(progress)
    except Exception as exc:  # the ledger out of reach: this reading keeps the job's own counts
        log.debug("running shards' counts not read: %s", exc)
        return progress


async def _read_progress(handle: WorkflowHandle[Any, JobSummary]) -> JobProgress | None:
    try:
        return await handle.query(
            PROGRESS_QUERY, result_type=JobProgress, rpc_timeout=QUERY_TIMEOUT
        )
    except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
        # No worker answered in time, or the run just continued as new: skip a beat.
        return None
