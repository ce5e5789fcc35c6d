"""The demo job: classify a customers CSV's companies into industries, end to end.

Starts the embedded stack, builds the tiny model when no model is named, uploads a
generated customers CSV to the embedded S3, runs a CPU and a GPU worker as child
processes, runs the job with a ``choice`` constraint and prints where results are.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from llmbatch.config import Settings
from llmbatch.devstack.process import LoggedProcess

INDUSTRIES = [
    "Law Firm",
    "Healthcare",
    "Technology",
    "Retail",
    "Consulting",
    "Manufacturing",
    "Finance",
    "Real Estate",
    "Other",
]
SYSTEM_PROMPT = "You sort companies into industries. Answer with the industry only."
USER_PROMPT = (
    "Company: {{ Company }} ({{ City }}, {{ Country }}; {{ Website }})\n"
    "Which industry is it in? One of: " + ", ".join(INDUSTRIES) + "."
)
# The embed demo's text: a short description of each customer's company.
EMBED_TEXT = "{{ Company }}, a company in {{ City }}, {{ Country }} ({{ Website }})"

_FIRST = [
    "Ava",
    "Liam",
    "Mia",
    "Noah",
    "Zoe",
    "Omar",
    "Ines",
    "Kenji",
    "Lena",
    "Raj",
    "Sara",
    "Tom",
]
_LAST = ["Smith", "Garcia", "Chen", "Okafor", "Novak", "Silva", "Kumar", "Berg", "Rossi", "Haddad"]
_STEMS = [
    "North",
    "Blue",
    "Summit",
    "Cedar",
    "Harbor",
    "Pioneer",
    "Atlas",
    "Bright",
    "Iron",
    "Vista",
]
_KINDS = [
    "Law Group", "Legal LLP", "Medical Center", "Health Partners", "Software", "Labs",
    "Outfitters", "Market", "Advisors", "Consulting", "Manufacturing Co", "Industries",
    "Capital", "Bank", "Realty", "Properties", "Holdings", "and Sons",
]  # fmt: skip
_PLACES = [
    ("Austin", "United States"), ("Leeds", "United Kingdom"), ("Lyon", "France"),
    ("Porto", "Portugal"), ("Pune", "India"), ("Osaka", "Japan"), ("Lagos", "Nigeria"),
    ("Toronto", "Canada"), ("Kraków", "Poland"), ("Curitiba", "Brazil"),
]  # fmt: skip
COLUMNS = ["Index", "Customer Id", "First Name", "Last Name", "Company", "City", "Country",
           "Phone", "Email", "Subscription Date", "Website"]  # fmt: skip


def customers_csv(rows: int, *, seed: int = 7) -> bytes:
    """A deterministic customers CSV, shaped like the usual sample-customers files."""
    rng = random.Random(seed)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for index in range(1, rows + 1):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        company = (
            f"{rng.choice(_STEMS)} {rng.choice([last, rng.choice(_STEMS)])} {rng.choice(_KINDS)}"
        )
        city, country = rng.choice(_PLACES)
        domain = company.lower().replace(" ", "")[:20]
        writer.writerow(
            [
                index,
                f"{rng.getrandbits(40):010x}",
                first,
                last,
                company,
                city,
                country,
                f"+1-{rng.randint(200, 999)}-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
                f"{first.lower()}.{last.lower()}@{domain}.example",
                f"202{rng.randint(0, 5)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                f"https://www.{domain}.example",
            ]
        )
    return buffer.getvalue().encode()


@contextmanager
def worker_processes(
    settings: Settings, model: str, *, log_dir: Path, gpu_args: list[str] | None = None
) -> Iterator[list[LoggedProcess]]:
    """Run ``llm-batch worker cpu`` and ``llm-batch worker gpu`` as child processes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "llmbatch.cli.main", "worker"]
    env = {**os.environ, **settings_env(settings)}
    procs: list[LoggedProcess] = []
    try:
        for name, args in (
            ("cpu", ["cpu"]),
            ("gpu", ["gpu", "--model", model, *(gpu_args or [])]),
        ):
            procs.append(LoggedProcess([*exe, *args], log=log_dir / f"worker-{name}.log", env=env))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def settings_env(settings: Settings) -> dict[str, str]:
    """The LLMBATCH_* variables that reproduce ``settings`` in a child process."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        raw = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        if isinstance(raw, list):  # local_roots: a PATH-style list, as Settings reads it
            raw = os.pathsep.join(str(item) for item in raw)
        elif isinstance(raw, dict):  # tenant_quotas: JSON, as Settings reads it
            raw = json.dumps(raw)
        env[f"LLMBATCH_{name.upper()}"] = str(raw)
    return env


_TRANSIENT = (
    RPCStatusCode.CANCELLED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.UNAVAILABLE,
)


async def wait_for_pollers(
    client: Client, task_queues: list[str], *, procs: Sequence[LoggedProcess], within_s: float
) -> None:
    """Wait until every task queue is polled by one of ``procs``; fail fast if one exits,
    with the last lines of its log (the cause, where a bare exit code says nothing).

    Temporal remembers pollers for minutes after they go, so a poller counts only if
    its identity (``<pid>@<host>``, the SDK's default) names one of our processes.
    """
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    ours = tuple(f"{proc.pid}@" for proc in procs)
    deadline = time.monotonic() + within_s
    pending = list(task_queues)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {proc.exit_message()}")
        queue = pending[0]
        try:
            response = await client.workflow_service.describe_task_queue(
                DescribeTaskQueueRequest(
                    namespace=client.namespace,
                    task_queue=TaskQueue(name=queue),
                    task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
                )
            )
        except RPCError as exc:
            # A busy server may cancel or time out one call; the next one will do.
            if exc.status not in _TRANSIENT:
                raise
        else:
            if any(p.identity.startswith(ours) for p in response.pollers):
                pending.pop(0)
                continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker polls {queue} after {within_s:.0f} s")
        await asyncio.sleep(0.5)
