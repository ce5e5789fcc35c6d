"""Faults of an endpoint that last (issue 53, item 6): unusable 200s and refused
connections no longer go on for ever. A job pays for a bounded number of unusable
answers, then pauses, as a refused key pauses it; a wrong base URL pauses it after
``LLMBATCH_REMOTE_PAUSE_AFTER_FAILING_S``; ``status`` shows the last error's class and
message all along, and the fix (``endpoint update``, ``resume``) reaches the running
worker.

The unusable answers, which vLLM's server does not give, are injected by the gateway
in front of it (:class:`~tests.fixtures.openai_server.GatewayFault`); the refused
connection is the operating system's own (a port nothing listens on).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from llmbatch.devstack.process import free_port
from tests.fixtures.openai_server import GatewayFault
from tests.fixtures.worker_processes import job_result
from tests.remote.conftest import RemoteCase, cli, until_paused

pytestmark = pytest.mark.slow

# The default of LLMBATCH_REMOTE_MAX_UNUSABLE_ANSWERS.
MAX_UNUSABLE = 20
CONCURRENCY = 4


@pytest.mark.parametrize(
    ("fault", "shown"),
    [
        (GatewayFault.HTML_200, "HTTP 200 but the body is not JSON: '<!DOCTYPE html>"),
        (GatewayFault.MALFORMED_JSON_200, 'HTTP 200 but the body is not JSON: \'{"id"'),
    ],
)
async def test_unusable_200s_pause_the_job_after_a_bounded_number(
    remote: RemoteCase, fault: GatewayFault, shown: str
) -> None:
    gateway = remote.gateway
    gateway.reload(fault=fault)
    endpoint = remote.endpoint("--max-concurrency", str(CONCURRENCY))
    spec = remote.job(endpoint, [{"text": f"Row {i}."} for i in range(20)])
    async with remote.workers(endpoint):
        handle = await remote.start(spec)
        progress = await until_paused(handle, within_s=60)
        assert progress.paused, "the job was not paused: unusable answers were sent again"
        await asyncio.sleep(3)  # nothing more is sent while paused
        paid = len(gateway.requests("/chat/completions"))
        status = await asyncio.to_thread(cli, remote.settings, "status", spec.job_id)
        data = json.loads(
            (await asyncio.to_thread(cli, remote.settings, "status", spec.job_id, "--json")).stdout
        )
        gateway.reload(fault=None)  # fixed
        resumed = await asyncio.to_thread(cli, remote.settings, "resume", spec.job_id)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        summary = await asyncio.wait_for(job_result(handle), 120)
    # Each unusable answer may be paid for: at most the limit, and what was in flight.
    assert MAX_UNUSABLE <= paid <= MAX_UNUSABLE + CONCURRENCY, paid
    paused = [line for line in status.stdout.splitlines() if "paused by llm-batch" in line]
    assert len(paused) == 1, status.stdout
    assert f"{MAX_UNUSABLE} unusable answers in a row" in paused[0]
    assert f"UnusableAnswer: {shown}" in paused[0] and "resume" in paused[0]
    last = [line for line in status.stdout.splitlines() if "this job's last error" in line]
    assert len(last) == 1 and f"UnusableAnswer: {shown}" in last[0], status.stdout
    [on_endpoint] = data["remote"]["endpoints"]
    assert on_endpoint["last_error_class"] == "UnusableAnswer"
    assert on_endpoint["last_error"].startswith(shown)
    remote.assert_exactly_once(spec, summary, 20)
    print(f"{fault.value}: {paid} requests sent for 20 rows before the pause")


async def test_a_wrong_base_url_says_connection_refused_pauses_and_an_update_fixes_it(
    remote: RemoteCase,
) -> None:
    port = free_port()  # nothing listens there
    endpoint = remote.endpoint(
        "--max-concurrency", str(CONCURRENCY), base_url=f"http://127.0.0.1:{port}/v1"
    )
    # The worker cannot list the endpoint's models: it is told which it serves.
    worker = remote.worker(
        endpoint,
        "remote-1",
        "--model",
        remote.server.model,
        env={"LLMBATCH_REMOTE_PAUSE_AFTER_FAILING_S": "6"},
    )
    await remote.polling(endpoint, [worker])
    spec = remote.job(endpoint, [{"text": f"Row {i}."} for i in range(20)])
    handle = await remote.start(spec)
    started = time.monotonic()

    # While it fails, before any pause, status names the error.
    async def refused_shown() -> dict[str, object] | None:
        done = await asyncio.to_thread(cli, remote.settings, "status", spec.job_id, "--json")
        [entry] = json.loads(done.stdout)["remote"]["endpoints"]
        return entry if entry["last_error_class"] else None

    for _ in range(60):
        if entry := await refused_shown():
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError("status never showed the job's last error")
    assert entry["last_error_class"] == "Unreachable"
    assert entry["last_error"] == f"connection refused: nothing listens at 127.0.0.1:{port}"

    progress = await until_paused(handle, within_s=60)
    assert progress.paused, "the job was not paused: refused connections were retried for ever"
    paused_after = time.monotonic() - started
    status = await asyncio.to_thread(cli, remote.settings, "status", spec.job_id)
    shown = cli(remote.settings, "endpoint", "show", endpoint)
    paused = [line for line in status.stdout.splitlines() if "paused by llm-batch" in line]
    assert len(paused) == 1, status.stdout
    assert "gave no answer for" in paused[0]
    assert f"Unreachable: connection refused: nothing listens at 127.0.0.1:{port}" in paused[0]
    assert "last error" in shown.stdout and "connection refused" in shown.stdout, shown.stdout

    # Fixed while the worker runs: it takes the new base URL within seconds.
    url = remote.gateway.base_url
    fixed = cli(remote.settings, "endpoint", "update", endpoint, "--base-url", url)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    await asyncio.sleep(2)
    resumed = await asyncio.to_thread(cli, remote.settings, "resume", spec.job_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = await asyncio.wait_for(job_result(handle), 120)
    remote.assert_exactly_once(spec, summary, 20)
    assert paused_after < 6 + 30
    print(f"wrong base URL: paused {paused_after:.1f} s after the start (limit 6 s)")
