"""Rendering prompt templates in child processes, each row under a time limit.

A template can loop for hours in pure Python. Rendered in the worker's own process
it would block the event loop that heartbeats, answers Temporal and handles SIGTERM,
and a thread cannot be stopped. So rows render in a child process (a fresh
interpreter: no copy of the worker's sockets, threads or event loop):

- the child stops a row itself when it passes ``RenderLimits.timeout_s`` (SIGALRM
  raises in the template's Python code, the cheap path), and caps its own memory
  (``RLIMIT_AS``) so a huge allocation is a ``MemoryError``, not the OOM killer;
- the parent waits for each row's answer at most ``timeout_s`` plus a grace; a row
  still running then (stuck inside one C call) has its child killed, the row dies,
  and a new child renders the rows after it.

Every failure is the row's: it comes back as a message for a dead item.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from llmbatch.contract.spec import ChatMessage
from llmbatch.rendering.limits import RenderLimits
from llmbatch.rendering.templates import PromptTemplate, TemplateError

#: A row's messages, or why it cannot be rendered.
Rendered = list[dict[str, str]] | TemplateError
Messages = tuple[tuple[str, str], ...]

# Past the row's own limit, how long the parent waits before it kills the child: a
# row stuck in one C call never sees the child's alarm.
KILL_GRACE_S = 2.0
# Starting a child (a fresh interpreter importing Jinja) takes this long at most.
START_TIMEOUT_S = 60.0
# Rows sent to a child at once (answers come back one by one). Sending blocks the event
# loop while the bytes go out: 64 rows of at most max_row_bytes each keep that short.
CHUNK_ROWS = 64

# Compiled templates a child keeps for the next shard of the same job.
_KEEP_TEMPLATES = 16
_READY = "ready"
_DIED = "died"
_LATE = "late"


class _RowTimeout(BaseException):
    """Raised in the child by SIGALRM: a BaseException, so that nothing on the way
    (Jinja's own exception handling included) takes it for the template's error."""


def _timeout_message(label: str, limits: RenderLimits) -> str:
    return f"{label}: rendering took longer than the {limits.timeout_s:g} s limit per row"


def _failure_message(what: str, limits: RenderLimits) -> str:
    if what == _LATE:
        return _timeout_message("the template", limits)
    return "the render process died while rendering this row (out of memory?)"


# ---------------------------------------------------------------- child process side


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _RowTimeout


def _cap_memory(extra_bytes: int) -> None:
    """Let the child's address space grow by ``extra_bytes`` past what it has now."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    current = pages * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _child_main(conn: Connection, limits: RenderLimits) -> None:
    # Ctrl-C reaches the whole process group: stopping is the worker's to decide, and
    # it kills this process when it does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _on_alarm)
    with contextlib.suppress(OSError, ValueError):
        _cap_memory(limits.max_memory_bytes)
    conn.send(_READY)
    templates: dict[Messages, PromptTemplate | TemplateError] = {}
    while True:
        try:
            messages, rows = conn.recv()
        except (EOFError, OSError):
            return  # the worker is gone
        template = templates.get(messages)
        if template is None:
            try:
                template = PromptTemplate(
                    [ChatMessage(role=r, content=c) for r, c in messages], limits
                )
            except TemplateError as exc:
                template = exc
            if len(templates) >= _KEEP_TEMPLATES:
                templates.clear()  # one per job: a long-lived child sees many jobs
            templates[messages] = template
        for row in rows:
            conn.send(_render_one(template, row, limits))


def _render_one(
    template: PromptTemplate | TemplateError, row: Mapping[str, Any], limits: RenderLimits
) -> Rendered:
    if isinstance(template, TemplateError):
        return template
    try:
        signal.setitimer(signal.ITIMER_REAL, limits.timeout_s)
        try:
            return template.render(row)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _RowTimeout:
        return TemplateError(_timeout_message(template.rendering or "the template", limits))
    except TemplateError as exc:
        return exc


# ---------------------------------------------------------------- worker side


class _Child:
    """One render process and the parent's end of its socket.

    A plain ``python -m llmbatch.rendering.pool`` process, not a multiprocessing
    ``spawn`` child: that one re-imports the worker's main module, which is the
    CLI, pytest, or whatever embeds the worker."""

    def __init__(self, limits: RenderLimits) -> None:
        parent, child = socket.socketpair()
        with child:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(child.fileno()), json.dumps(asdict(limits))],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                # The same llmbatch as the worker's, wherever that was imported from.
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        self.conn = Connection(parent.detach())

    # Callers wait for the child's imports before they send rows, so that the imports
    # never count against a row's time.

    async def ready(self) -> None:
        if await self.answer(START_TIMEOUT_S) != _READY:
            raise RuntimeError(f"a render process did not start within {START_TIMEOUT_S:g} s")

    def ready_sync(self) -> None:
        if self.answer_sync(START_TIMEOUT_S) != _READY:
            raise RuntimeError(f"a render process did not start within {START_TIMEOUT_S:g} s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)

    async def answer(self, timeout_s: float) -> Rendered | str:
        """The next row's answer; ``_LATE`` if none came within ``timeout_s``, ``_DIED``
        if the child is gone."""
        if not self.conn.poll():
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            fd = self.conn.fileno()

            def wake() -> None:
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(fd, wake)
            try:
                await asyncio.wait_for(ready, timeout_s)
            except TimeoutError:
                return _LATE
            finally:
                loop.remove_reader(fd)
        return _received(self.conn)

    def answer_sync(self, timeout_s: float) -> Rendered | str:
        if not self.conn.poll(timeout_s):
            return _LATE
        return _received(self.conn)


def _received(conn: Connection) -> Rendered | str:
    try:
        answer: Rendered | str = conn.recv()
    except (EOFError, OSError):
        # The child died mid-row (killed from outside, or by the OOM killer).
        return _DIED
    return answer


def _messages_key(messages: Sequence[ChatMessage]) -> Messages:
    return tuple((m.role, m.content) for m in messages)


class RenderPool:
    """Render processes of one worker: idle ones are kept (up to ``keep_idle``) for
    the next shard; a render that finds none idle starts one, so a runaway template
    in one job never makes another job's render wait for a process."""

    def __init__(self, limits: RenderLimits, *, keep_idle: int = 2) -> None:
        self.limits = limits
        self._keep_idle = keep_idle
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._closed = False

    async def render(
        self, messages: Sequence[ChatMessage], rows: Sequence[Mapping[str, Any]]
    ) -> list[Rendered]:
        """Each row's messages or its TemplateError, in order. Cancelling this kills
        the child that is rendering."""
        key = _messages_key(messages)
        out: list[Rendered] = []
        child: _Child | None = None
        try:
            while len(out) < len(rows):
                if child is None:
                    child = await self._take()
                chunk = rows[len(out) : len(out) + CHUNK_ROWS]
                child.conn.send((key, list(chunk)))
                for _ in chunk:
                    answer = await child.answer(self.limits.timeout_s + KILL_GRACE_S)
                    if isinstance(answer, str):
                        # Late: stuck where the child's alarm cannot reach; or died.
                        # Either way this row is the culprit, and the child is done.
                        out.append(TemplateError(_failure_message(answer, self.limits)))
                        self._discard(child)
                        child = None
                        break
                    out.append(answer)
        except BaseException:
            # Cancelled (the activity, or the worker stopping): stop the render now.
            if child is not None:
                self._discard(child)
                child = None
            raise
        finally:
            if child is not None:
                self._give_back(child)
        return out

    def close(self) -> None:
        """Kill every render process, busy ones too (the worker is stopping)."""
        self._closed = True
        for child in [*self._idle, *self._busy]:
            child.kill()
        self._idle.clear()
        self._busy.clear()

    async def _take(self) -> _Child:
        if self._closed:
            raise RuntimeError("the render pool is closed")
        while self._idle:
            child = self._idle.pop()
            if child.alive():
                self._busy.add(child)
                return child
            child.kill()
        child = _Child(self.limits)
        self._busy.add(child)
        try:
            await child.ready()
        except BaseException:
            self._discard(child)  # cancelled while it started, or it never did
            raise
        return child

    def _give_back(self, child: _Child) -> None:
        self._busy.discard(child)
        if self._closed or len(self._idle) >= self._keep_idle:
            child.kill()
        else:
            self._idle.append(child)

    def _discard(self, child: _Child) -> None:
        self._busy.discard(child)
        child.kill()


def render_isolated(
    messages: Sequence[ChatMessage], row: Mapping[str, Any], limits: RenderLimits
) -> Rendered:
    """Render one row in a child process of its own, under ``limits`` (blocking: for
    the check at submit, which runs in a thread)."""
    child = _Child(limits)
    try:
        child.ready_sync()
        child.conn.send((_messages_key(messages), [dict(row)]))
        answer = child.answer_sync(limits.timeout_s + KILL_GRACE_S)
        return (
            TemplateError(_failure_message(answer, limits)) if isinstance(answer, str) else answer
        )
    finally:
        child.kill()


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])), RenderLimits(**json.loads(sys.argv[2])))
