"""Processes a worker starts die with it, even when it is SIGKILLed.

vLLM's EngineCore does not watch the process that started it: a GPU worker killed
with SIGKILL (OOM killer, ``kill -9``, a lost container runtime) left its EngineCore
running, re-parented to init, holding the model's memory (on a GPU: its VRAM, so the
restarted worker could not load). Linux's ``PR_SET_PDEATHSIG`` has the kernel send a
signal to a process when its parent dies; it is set in every process the engine
starts, forked (an ``os.register_at_fork`` hook) or spawned (``llmbatch.cli.main``,
which a spawned child imports as its ``__mp_main__``, calls :func:`on_main_import`).
Only processes started inside :func:`children_die_with_us` are marked.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# Set while children_die_with_us is active: a spawned child inherits it and marks
# itself (its own children, vLLM's Worker processes, inherit it in turn).
ENV = "LLMBATCH_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1
_marking = False
_hooked = False


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; a no-op
    elsewhere). A parent that died already (we were re-parented) ends us now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("PR_SET_PDEATHSIG failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() == 1:
        os._exit(1)


def _after_fork_in_child() -> None:
    if _marking:
        die_with_parent()


@contextmanager
def children_die_with_us() -> Iterator[None]:
    """Every process started in this block (and their own children) dies with the one
    that started it. Enter it on the thread that starts them and lives as long as they
    should (the kernel ties the signal to the creating thread)."""
    global _marking, _hooked
    if not _hooked:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooked = True
    saved = os.environ.get(ENV)
    os.environ[ENV] = "1"
    _marking = True
    try:
        yield
    finally:
        _marking = False
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def on_main_import(module_name: str) -> None:
    """Called with ``__name__`` at the import of the main module: in a
    ``multiprocessing`` child spawned inside :func:`children_die_with_us` (which runs
    it as ``__mp_main__``), mark it."""
    if module_name == "__mp_main__" and os.environ.get(ENV) == "1":
        die_with_parent()
