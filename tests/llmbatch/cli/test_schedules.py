"""``llm-batch schedule``: real Temporal Schedules on the session's stack.

The CLI runs as a subprocess (the workers turn in this test's event loop); the runs a
schedule starts are real jobs, done by the session's workers.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import typer
from temporalio.client import Client
from typer.core import TyperGroup

from llmbatch import ledger
from llmbatch.cli.main import app
from llmbatch.client import schedules
from llmbatch.config import Settings
from llmbatch.contract import search_attributes as sa
from llmbatch.contract.messages import JobSummary
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

ROWS = 12
# Enough for the server's every-minute tick, plus a small job on a busy machine.
RUN_TIMEOUT_S = 240


def tickets(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(ROWS)))
    return path


def job_args(data: Path, model: str, out: Path) -> list[str]:
    return [
        "--input", str(data), "--model", model, "--user", "Ticket: {{ text }}",
        "--choices", "bug,billing", "--max-tokens", "4", "--shard-size", "5",
        "--output", f"file://{out}",
    ]  # fmt: skip


async def runs_of(client: Client, name: str, *, at_least: int) -> list[str]:
    """Job ids of the schedule's runs, oldest first, once there are ``at_least``."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        summary = await schedules.describe_schedule(client, name)
        jobs = [r.job_id for r in summary.recent_runs]
        if len(jobs) >= at_least:
            return jobs
        assert time.monotonic() < deadline, f"{name}: {len(jobs)} runs, waited for {at_least}"
        await asyncio.sleep(1)


async def finished(client: Client, job_id: str) -> JobSummary:
    handle = client.get_workflow_handle(job_id, result_type=JobSummary)
    return await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)


async def item_count(settings: Settings, job_id: str) -> int:
    pool = await ledger.db.create_pool(settings.postgres_dsn.get_secret_value())
    try:
        return (await ledger.jobs.job_counts(pool, job_id=job_id)).succeeded
    finally:
        await pool.close()


async def test_every_scheduled_run_is_a_job_of_its_own(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    data, out = tickets(tmp_path / "tickets.jsonl"), tmp_path / "out"
    code, stdout, err = await cli(
        workers, "schedule", "create", name, "--cron", "* * * * *", "--json",
        *job_args(data, model_name, out),
    )  # fmt: skip
    assert code == 0, err
    created = json.loads(stdout)
    assert created["name"] == name and created["cron"] == ["* * * * *"]
    assert created["model"] == model_name and created["next_runs"]
    try:
        code, _, err = await cli(
            workers, "schedule", "create", name, "--cron", "0 2 * * *",
            *job_args(data, model_name, out),
        )  # fmt: skip
        assert code == 1 and f"schedule {name!r} exists already" in err
        assert len(err.strip().splitlines()) == 1

        # The first run comes from the cron tick itself: its job id is the workflow id
        # Temporal gave it, "<name>-<scheduled UTC time>".
        first = (await runs_of(temporal_client, name, at_least=1))[0]
        assert re.fullmatch(rf"{name}-\d{{4}}-\d\d-\d\dT\d\d:\d\d:00Z", first), first
        summary = await finished(temporal_client, first)
        assert summary.job_id == first
        assert (summary.items_total, summary.items_succeeded) == (ROWS, ROWS)
        description = await temporal_client.get_workflow_handle(first).describe()
        assert description.typed_search_attributes.get(sa.JOB_ID) == first
        assert description.typed_search_attributes.get(sa.MODEL) == model_name

        # A second run (triggered, or the next tick if it came first) is a new job: it
        # does every item again instead of finding them done under a shared id.
        code, _, err = await cli(workers, "schedule", "trigger", name)
        assert code == 0, err
        runs = await runs_of(temporal_client, name, at_least=2)
        second = next(job for job in runs if job != first)
        summary = await finished(temporal_client, second)
        assert summary.job_id == second
        assert (summary.items_total, summary.items_succeeded) == (ROWS, ROWS)
        assert await item_count(workers, first) == ROWS
        assert await item_count(workers, second) == ROWS
        assert len(list((out / first).glob("part-*.jsonl"))) == 3
        assert len(list((out / second).glob("part-*.jsonl"))) == 3

        code, stdout, err = await cli(workers, "schedule", "list", "--json")
        assert code == 0, err
        listed = {s["name"]: s for s in json.loads(stdout)}
        assert listed[name]["inputs"] == [str(data)]
        assert {first, second} <= {r["job_id"] for r in listed[name]["recent_runs"]}
        code, stdout, _ = await cli(workers, "schedule", "list")
        assert code == 0 and name in stdout and "* * * * *" in stdout
    finally:
        code, stdout, err = await cli(workers, "schedule", "delete", name, "--json")
    assert code == 0, err
    assert json.loads(stdout) == {"name": name, "deleted": True}
    code, _, err = await cli(workers, "schedule", "delete", name)
    assert code == 1 and f"no schedule {name!r}" in err


async def test_bad_schedules_are_refused_in_one_line(stack: Settings, tmp_path: Path) -> None:
    data, out = tickets(tmp_path / "tickets.jsonl"), tmp_path / "out"
    args = job_args(data, "some-model", out)

    async def refused(*command: str) -> str:
        code, _, err = await cli(stack, "schedule", *command)
        assert code == 1, err
        assert len(err.strip().splitlines()) == 1, err
        return err

    assert "cron" in await refused("create", "bad-cron", "--cron", "every tuesday", *args)
    assert "bad schedule name" in await refused("create", "a:b", "--cron", "0 2 * * *", *args)
    zone = await refused("create", "tz", "--cron", "0 2 * * *", "--timezone", "Mars/Base", *args)
    assert "unknown time zone" in zone
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"job_id": "fixed"}))
    with_id = await refused("create", "fixed-id", "--cron", "0 2 * * *", "--spec", str(spec), *args)
    assert "leave job_id out" in with_id
    missing = args.copy()
    missing[1] = str(tmp_path / "missing.jsonl")
    assert "does not exist" in await refused("create", "later", "--cron", "0 2 * * *", *missing)
    assert "no schedule 'nope'" in await refused("delete", "nope")
    assert "no schedule 'nope'" in await refused("trigger", "nope")
    # Runs name their own jobs; there is no --job-id to give.
    code, _, err = await cli(
        stack, "schedule", "create", "x", "--cron", "0 2 * * *", "--job-id", "j", *args
    )
    assert code == 2 and "--job-id" in err

    # --no-check: inputs that appear later are fine; nothing was created by the above.
    code, _, err = await cli(
        stack, "schedule", "create", f"later-{uuid.uuid4().hex[:6]}", "--cron", "0 2 * * *",
        "--paused", "--no-check", *missing,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, _ = await cli(stack, "schedule", "list", "--json")
    names = {s["name"] for s in json.loads(stdout)}
    assert not names & {"bad-cron", "tz", "fixed-id", "later", "x"}
    later = [s for s in json.loads(stdout) if s["name"].startswith("later-")]
    assert later and later[0]["paused"]
    code, _, err = await cli(stack, "schedule", "delete", later[0]["name"])
    assert code == 0, err


def _params(command: Any) -> dict[str, dict[str, Any]]:
    return {
        p.name: {
            "opts": p.opts,
            "type": p.type_descriptor.annotation,
            "default": p.default,
            "multiple": p.multiple,
            "required": p.required,
            "help": getattr(p, "help", None),
        }
        for p in command.params
        if p.name
    }


def test_schedule_create_takes_every_job_option_of_submit() -> None:
    """Both get the job options from llmbatch.cli._support.options (declared once there); this
    checks that each command really presents all of them to Typer, alike."""
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    submit = root.commands["submit"]
    group = root.commands["schedule"]
    assert isinstance(group, TyperGroup)
    create = group.commands["create"]
    job_options = {
        name: param
        for name, param in _params(submit).items()
        # What only a one-off submit has: its own id, following it, checks made when
        # it starts (a schedule's runs are checked by plan_job each time), and the
        # estimate of one submit's cost instead of running it.
        if name not in {"job_id", "wait", "as_json", "require_worker", "attach", "estimate"}
    }
    create_params = _params(create)
    assert len(job_options) >= 20
    for name, param in job_options.items():
        assert create_params.get(name) == param, name
    assert "job_id" not in create_params
