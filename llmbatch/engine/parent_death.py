"""Processes a worker starts die with it, even when it is SIGKILLed.

vLLM's EngineCore does not watch the process that started it, nor do its Workers while
they load: a GPU worker killed with SIGKILL (OOM killer, ``kill -9``, a lost container
runtime) left its EngineCore and Workers running, re-parented, holding the model's
memory (on a GPU: its VRAM, so the restarted worker could not load). Linux's
``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent dies.

Every process started inside :func:`children_die_with_us` sets it on itself, first
thing, whatever started the worker (the console script, ``python -m``, a program of
the user's, a container whose main process it is):

- a forked process in an ``os.register_at_fork`` hook;
- a spawned one (vLLM spawns on CPU, and on a GPU once CUDA is initialised) when vLLM
  loads its general plugins, which EngineCore and each Worker do before they build
  anything: :func:`mark_if_started_by_us` is one (``pyproject.toml`` registers it);
- and earlier than that when the child's main module imports ``llmbatch.cli.main``,
  which calls it too: a spawned child re-runs its parent's main module, which for the
  console script and ``python -m`` leads there.

The creator names itself in the environment (``LLMBATCH_DIE_WITH_PARENT=<its pid>``),
which its children inherit. A process that finds another pid there was started in the
block. It names itself in turn, so that its own children (the Workers under
EngineCore) die with it. If the creator is gone by the time the child marks itself,
the child ends at once. The check is against that pid, not against 1: a worker that
is PID 1, as a container's main process is, is its children's living parent.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Imported by the CLI at every start (see llmbatch.cli.main), so what only a marked
# process needs (ctypes, psutil, logging) is imported where it is used.

# The pid of the process whose children must die with it; inherited by every child.
ENV = "LLMBATCH_DIE_WITH_PARENT"
# Its name as a vLLM general plugin (pyproject.toml), for VLLM_PLUGINS allow-lists.
VLLM_PLUGIN = "llmbatch_die_with_parent"
_PR_SET_PDEATHSIG = 1
_marking = False
_hooked = False


def die_with_parent(creator: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; a no-op
    elsewhere). If ``creator``, the process that started us, died before this call
    (we were re-parented, so the kernel will not tell us), end now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import logging
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logging.getLogger(__name__).warning("PR_SET_PDEATHSIG failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() != creator and _gone(creator):
        os._exit(1)


def _gone(pid: int) -> bool:
    # A creator that exited but is not reaped yet is a zombie: gone too.
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def mark_if_started_by_us() -> None:
    """In a process started inside :func:`children_die_with_us` (of this or another
    process), die with the parent, and have every process this one starts die with it.
    Elsewhere (the creator itself, a process no engine started) a no-op; safe to call
    more than once."""
    creator = os.environ.get(ENV)
    if not creator or not creator.isdigit() or int(creator) == os.getpid():
        return
    die_with_parent(int(creator))
    _mark_children()


def _mark_children() -> None:
    global _marking, _hooked
    if not _hooked:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooked = True
    os.environ[ENV] = str(os.getpid())
    _marking = True


def _after_fork_in_child() -> None:
    if _marking:
        mark_if_started_by_us()


@contextmanager
def children_die_with_us() -> Iterator[None]:
    """Every process started in this block (and their own children) dies with the one
    that started it. Enter it on the thread that starts them and lives as long as they
    should (the kernel ties the signal to the creating thread)."""
    global _marking
    saved = {name: os.environ.get(name) for name in (ENV, "VLLM_PLUGINS")}
    # An allow-list of vLLM plugins (VLLM_PLUGINS) would leave ours out of the children.
    allowed = saved["VLLM_PLUGINS"]
    if allowed is not None and VLLM_PLUGIN not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = f"{allowed},{VLLM_PLUGIN}" if allowed else VLLM_PLUGIN
    _mark_children()
    try:
        yield
    finally:
        _marking = False
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
