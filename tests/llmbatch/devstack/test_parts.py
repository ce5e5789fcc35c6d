"""The embedded stack's servers one at a time, started for real."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from llmbatch.devstack import isolated_settings
from llmbatch.devstack.parts import PORT_TAKEN, TemporalPart

pytestmark = pytest.mark.slow


def test_temporal_is_started_again_when_a_port_it_picked_was_taken(tmp_path: Path) -> None:
    # The fault the retry is for (a port of Temporal's inner services taken between its
    # look and its bind) cannot be produced on demand: a port of ours, held by a socket
    # until the first start has exited on it, gives the server the same death.
    temporal = TemporalPart(isolated_settings(tmp_path / "state"))
    temporal.plan_ports(set())
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", temporal.ports["http"]))
    held.listen()

    def release_once_refused() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if temporal.log.exists() and PORT_TAKEN in temporal.log.read_text(errors="replace"):
                break
            time.sleep(0.02)
        held.close()

    releaser = threading.Thread(target=release_once_refused, daemon=True)
    releaser.start()
    try:
        temporal.start()
        assert temporal.running()
        starts = temporal.log.read_text(errors="replace").count(" start: ")
        assert starts == 2  # the first exited on the taken port, the second runs
    finally:
        temporal.stop()
        releaser.join(timeout=5)
        held.close()
