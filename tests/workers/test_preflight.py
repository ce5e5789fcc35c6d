"""Worker start-up: an unreachable or misconfigured service is one line, exit code 1.

Real ``llm-batch worker cpu|gpu`` processes start against the session stack with one
setting spoilt each time. Each must stop within seconds, before polling, with exactly
one line on stderr naming the service and where it is, and no password anywhere.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from llmbatch.config import Settings
from llmbatch.devstack.demo import settings_env
from llmbatch.devstack.process import free_port

# A password in every DSN these tests give: it must show nowhere.
PASSWORD = "pw-never-shown"
# Python start-up and imports take a few seconds on a loaded machine; a check that
# waited for a timeout of its own, or loaded an engine, would take far longer.
WITHIN_S = 30.0
# How long Temporal is gone before a worker is stopped: long enough for its polls to
# have failed (the worker retries them for a few seconds).
LOST_FOR_S = 3.0


def with_password(dsn: str) -> str:
    return dsn.replace("postgres@", f"postgres:{PASSWORD}@")


def start_worker(
    settings: Settings, overrides: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``llm-batch worker <args>`` with ``overrides`` on the stack's settings until
    it exits; return it and how long it ran."""
    env = {**os.environ, **settings_env(settings), **overrides}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", "worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WITHIN_S * 2,
    )
    return done, time.monotonic() - began


def assert_one_line(done: subprocess.CompletedProcess[str], elapsed: float, *expected: str) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # no traceback, no log noise
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in expected:
        assert fragment in line, line
    assert PASSWORD not in done.stdout + done.stderr
    assert elapsed < WITHIN_S
    return line


def unused_port() -> str:
    return str(free_port(avoid=set()))


# Each case: what to spoil (from the stack's settings) and what the line must name.
Case = Callable[[Settings], tuple[dict[str, str], list[str]]]


def temporal_unreachable(s: Settings) -> tuple[dict[str, str], list[str]]:
    address = f"127.0.0.1:{unused_port()}"
    return {"LLMBATCH_TEMPORAL_ADDRESS": address}, [f"cannot reach Temporal at {address}"]


def postgres_unreachable(s: Settings) -> tuple[dict[str, str], list[str]]:
    port = unused_port()
    dsn = with_password(s.postgres_dsn.get_secret_value()).replace(
        f":{s.postgres_port}/", f":{port}/"
    )
    return {"LLMBATCH_POSTGRES_DSN": dsn}, [
        f"cannot reach Postgres at postgresql://postgres:***@127.0.0.1:{port}/llmbatch"
    ]


def postgres_refuses(s: Settings) -> tuple[dict[str, str], list[str]]:
    dsn = with_password(s.postgres_dsn.get_secret_value()).replace("/llmbatch", "/no_such_db")
    return {"LLMBATCH_POSTGRES_DSN": dsn}, [
        f"Postgres at postgresql://postgres:***@127.0.0.1:{s.postgres_port}/no_such_db refused",
        "no_such_db",
    ]


def s3_unreachable(s: Settings) -> tuple[dict[str, str], list[str]]:
    endpoint = f"http://127.0.0.1:{unused_port()}"
    return {"LLMBATCH_S3_ENDPOINT_URL": endpoint}, [f"cannot reach S3 at {endpoint}"]


def bucket_missing(s: Settings) -> tuple[dict[str, str], list[str]]:
    return {"LLMBATCH_S3_BUCKET": "no-such-bucket"}, [
        f"S3 at {s.s3_endpoint_url} has no bucket 'no-such-bucket'"
    ]


def s3_credentials_refused(s: Settings) -> tuple[dict[str, str], list[str]]:
    return {"LLMBATCH_S3_SECRET_ACCESS_KEY": PASSWORD}, [
        f"S3 at {s.s3_endpoint_url} refused the credentials"
    ]


@pytest.mark.parametrize(
    "case",
    [
        temporal_unreachable,
        postgres_unreachable,
        postgres_refuses,
        s3_unreachable,
        bucket_missing,
        s3_credentials_refused,
    ],
)
def test_cpu_worker_stops_at_start_with_one_line(stack: Settings, case: Case) -> None:
    overrides, expected = case(stack)
    done, elapsed = start_worker(stack, overrides, "cpu")
    assert_one_line(done, elapsed, *expected)
    assert "polling" not in done.stdout  # stopped before it polled


def test_cpu_worker_refuses_a_database_without_migrations(
    stack: Settings, empty_db_dsn: str
) -> None:
    done, elapsed = start_worker(stack, {"LLMBATCH_POSTGRES_DSN": empty_db_dsn}, "cpu")
    assert_one_line(done, elapsed, "has 0 of llm-batch's", "llm-batch migrate")


def test_gpu_worker_checks_postgres_before_it_loads_the_engine(stack: Settings) -> None:
    """The model does not exist: had the engine been started first, its load would
    have failed differently, and later."""
    overrides, expected = postgres_unreachable(stack)
    done, elapsed = start_worker(
        stack, overrides, "gpu", "--model", "/nonexistent/model", "--max-model-len", "128"
    )
    line = assert_one_line(done, elapsed, *expected)
    assert "model" not in line


async def test_cpu_worker_that_loses_temporal_stops_with_one_line(stack: Settings) -> None:
    """Temporal goes away under a polling worker; stopped then, the worker says so in
    one line (exit code 1) instead of a traceback."""
    env = await WorkflowEnvironment.start_local(
        namespace=stack.temporal_namespace,
        dev_server_existing_path=shutil.which("temporal")
        or str(Path(sys.executable).parent / "temporal"),
    )
    address = env.client.service_client.config.target_host
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmbatch.cli.main", "worker", "cpu",
        env={**os.environ, **settings_env(stack), "LLMBATCH_TEMPORAL_ADDRESS": address},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), WITHIN_S)
        assert b"polling" in first
    finally:
        await env.shutdown()
    await asyncio.sleep(LOST_FOR_S)  # its polls fail meanwhile
    proc.send_signal(signal.SIGTERM)
    began = time.monotonic()
    stdout, stderr = await asyncio.wait_for(proc.communicate(), WITHIN_S * 4)
    assert proc.returncode is not None  # communicate() returns once it exited
    done = subprocess.CompletedProcess(
        ["worker", "cpu"], proc.returncode, (first + stdout).decode(), stderr.decode()
    )
    assert_one_line(done, time.monotonic() - began, "cpu worker stopped", "Temporal")


def test_gpu_worker_whose_engine_does_not_fit_its_memory_node_stops_with_one_line(
    stack: Settings, tiny_model_path: Path
) -> None:
    """On CPU a memory share is of the engine's memory node, and 0.01 of any node is
    less than the engine process needs: vLLM would load the model and then fail with a
    traceback about a negative KV cache. The worker says what was asked, what the node
    has and which option to change, in one line, before the model loads."""
    env = {**os.environ, **settings_env(stack)}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "llmbatch.cli.main", "worker", "gpu",
         "--model", str(tiny_model_path), "--max-model-len", "128",
         "--gpu-memory-utilization", "0.01"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --gpu-memory-utilization 0.01 asks for"), line
    for fragment in ("of memory node", "GiB free of", "--kv-cache-memory-bytes"):
        assert fragment in line, line
    assert "polling" not in done.stdout
    # Refused before the model loaded: no engine process was started.
    assert "EngineCore" not in done.stdout + done.stderr
    assert time.monotonic() - began < 120
