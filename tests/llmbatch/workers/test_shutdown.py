"""A stop signal while a worker starts ends the start at once, even inside a blocking
call (a model load holds the main thread; no event loop turns until it returns).
The signal is real (SIGTERM to this process); what ``end`` kills is a stand-in."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from llmbatch.workers.shutdown import StoppableStart, StoppedWhileStarting


def test_sigterm_ends_a_blocking_start_once_and_the_handlers_come_back() -> None:
    ended: list[float] = []
    start = StoppableStart(end=lambda: ended.append(time.monotonic()))
    before = signal.getsignal(signal.SIGTERM)
    sent = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    began = time.monotonic()
    with pytest.raises(StoppedWhileStarting) as stopped, start:
        sent.start()
        time.sleep(30)  # the load: a blocking call, as vLLM's engine build is
    assert time.monotonic() - began < 10
    assert stopped.value.code == 0 and stopped.value.signal is signal.SIGTERM
    assert start.signal is signal.SIGTERM
    assert len(ended) == 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_start_without_a_signal_is_left_alone() -> None:
    start = StoppableStart(end=lambda: pytest.fail("ended without a signal"))
    with start:
        pass
    assert start.signal is None
