"""Detached server processes: start, wait until ready, stop; free ports; a state lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil

from llmbatch.errors import LlmBatchError

# SeaweedFS reaches some gRPC services at "http port + 10000" whatever their flags say.
GRPC_OFFSET = 10000
# Ports we pick stay below this, so their gRPC twin is a valid port too.
_HIGHEST_PICK = 65535 - GRPC_OFFSET


class LoggedProcess(subprocess.Popen[bytes]):
    """A child process whose output goes to ``log``, so that when it dies early its
    last lines can say why (a worker that refused its options, an engine that did not
    fit): ``exit_message`` is what a caller waiting on it raises with."""

    def __init__(
        self, args: Sequence[str], *, log: Path, env: dict[str, str], new_session: bool = False
    ) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            super().__init__(
                list(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                # A group of its own: a signal to the group reaches its children too.
                start_new_session=new_session,
            )

    def exit_message(self, lines: int = 15) -> str:
        """The exit code and the last ``lines`` lines of the log."""
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        shown = "\n".join(f"    {line}" for line in tail)
        return f"{self.args!r} exited with {self.returncode}; last lines of {self.log}:\n{shown}"


class DevStackError(LlmBatchError, RuntimeError):
    """A part of the embedded stack failed; the message is one line naming part and log."""


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port in TIME_WAIT after our own `down` counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(
    host: str = "127.0.0.1", *, avoid: set[int] | None = None, grpc_twin: bool = False
) -> int:
    """A port nothing listens on now, not in ``avoid``; with ``grpc_twin`` port+10000 too."""
    avoid = avoid or set()
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port >= _HIGHEST_PICK or port in avoid:
            continue
        if grpc_twin and (port + GRPC_OFFSET in avoid or not port_free(port + GRPC_OFFSET, host)):
            continue
        return port


def started_at(pid: int | None) -> float | None:
    """The process's start time (to tell it from a later process that reuses its pid)."""
    if not pid:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def alive(pid: int | None, started: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if ``started`` is given, is that process."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False


def start(
    argv: Sequence[str],
    *,
    log: Path,
    env: dict[str, str] | None = None,
    user: str | None = None,
    cwd: Path | None = None,
) -> int:
    """Start ``argv`` in its own session (it outlives this process); return its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {argv[0]}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            user=user,
            start_new_session=True,
        )
    return proc.pid


def last_log_line(log: Path, *, limit: int = 200) -> str:
    """The log's last non-empty line, on one line and cut to ``limit`` characters."""
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    line = " ".join(lines[-1].split()) if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def wait_ready(
    part: str,
    ready: Callable[[], bool],
    *,
    pid: int,
    log: Path,
    within_s: float,
) -> None:
    """Poll ``ready`` until it holds; fail at once if the process dies, or at the deadline.

    ``ready`` must bound its own waiting (timeouts on every call) so the deadline holds.
    """
    deadline = time.monotonic() + within_s
    while True:
        if not alive(pid):
            last = last_log_line(log)
            said = f" (last log line: {last})" if last else ""
            raise DevStackError(f"{part} exited while starting{said}; see its log {log}")
        with contextlib.suppress(Exception):
            if ready():
                return
        if time.monotonic() > deadline:
            raise DevStackError(
                f"{part} did not become ready in {within_s:.0f} s; see its log {log}"
            )
        time.sleep(0.25)


def stop(pid: int | None, *, first: signal.Signals = signal.SIGTERM, grace_s: float = 20.0) -> None:
    """Stop a process and everything in its session; SIGKILL after ``grace_s``."""
    if not alive(pid):
        return
    assert pid is not None
    try:
        leader = psutil.Process(pid)
        group = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return
    with contextlib.suppress(psutil.Error):
        leader.send_signal(first)
    left = _wait_gone([leader], within_s=grace_s)
    for proc in left + group[1:]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    # Anything left in the process group (started with start_new_session, so pgid == pid),
    # even if it was re-parented away from the leader.
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    _wait_gone(group, within_s=5)


def _wait_gone(procs: list[psutil.Process], *, within_s: float) -> list[psutil.Process]:
    """Wait until ``procs`` have exited; return those still running at the deadline.

    An exited process whose parent is another live process stays a zombie until that
    parent reaps it (the test run or ``llm-batch demo`` that ran ``up``), so a zombie
    counts as gone; our own children are reaped here.
    """
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.wait(timeout=0)  # reaps it if it is our exited child
                continue
            if _running(proc):
                left.append(proc)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` so two `up`/`down` calls never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
