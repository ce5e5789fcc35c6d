"""Detached server processes: start, wait until ready, stop, and free-port checks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil


class DevStackError(RuntimeError):
    """A part of the embedded stack failed; the message is one line naming part and log."""


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, avoid: set[int] | None = None) -> int:
    """A port nothing listens on now (and not in ``avoid``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        # gRPC ports of SeaweedFS are http port + 10000: keep both in range.
        if port < 55000 and (avoid is None or port not in avoid):
            return port


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
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


def wait_ready(
    part: str,
    ready: Callable[[], bool],
    *,
    pid: int,
    log: Path,
    within_s: float,
) -> None:
    """Poll ``ready`` until it holds; fail at once if the process dies, or at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        if not alive(pid):
            raise DevStackError(f"{part} exited while starting; see its log {log}")
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
        group = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    with contextlib.suppress(psutil.Error):
        group[0].send_signal(first)
    _, left = psutil.wait_procs(group[:1], timeout=grace_s)
    for proc in left + group[1:]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(group, timeout=5)
