"""The job commands, run as a real ``llm-batch`` process against the session's stack.

The workers run in this test process's event loop, so the CLI runs as an async
subprocess while the test awaits it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.contract.messages import JobSummary
from llmbatch.demo import settings_env

pytestmark = pytest.mark.slow


async def cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmbatch.cli.main",
        *args,
        env={**os.environ, **settings_env(settings), "COLUMNS": "200"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_schema_is_json_schema_of_the_job_spec(stack: Settings) -> None:
    code, out, _ = await cli(stack, "schema")
    schema = json.loads(out)
    assert code == 0 and schema["title"] == "JobSpec"
    assert "sampling" in schema["properties"]


async def test_bad_submissions_fail_in_one_line(stack: Settings, tmp_path: Path) -> None:
    code, _, err = await cli(
        stack, "submit", "--input", str(tmp_path / "missing.csv"), "--model", "m", "--user", "{{x}}"
    )
    assert code == 1 and "missing.csv does not exist" in err
    assert len(err.strip().splitlines()) == 1

    data = tmp_path / "rows.csv"
    data.write_text("name,city\nAcme,Lyon\n")
    code, _, err = await cli(
        stack, "submit", "--input", str(data), "--model", "m", "--user", "{{ company }}"
    )
    assert code == 1 and "company" in err and "city, name" in err

    code, _, err = await cli(
        stack, "submit", "--input", str(data), "--model", "m", "--user", "{{ name }}",
        "--choices", "a", "--regex", "b",
    )  # fmt: skip
    assert code == 1 and "at most one structured-output constraint" in err


async def test_submit_refuses_a_template_that_fails_on_the_first_row(
    stack: Settings, tmp_path: Path
) -> None:
    data = tmp_path / "rows.csv"
    data.write_text("name,city\n\nAcme Secret Labs,Lyon\nB,C\n")
    quick = stack.model_copy(update={"render_timeout_s": 1})
    cases = {
        "{{ name.__class__ }}": "unsafe attribute or call '__class__' (SecurityError)",
        "{{ name * 100000000 }}": "too large",
        "{{ {'a': 1}[name] }}": "undefined attribute or item (UndefinedError)",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": (
            "took longer than the 1 s limit per row"
        ),
    }
    for template, words in cases.items():
        code, _, err = await cli(
            quick, "submit", "--input", str(data), "--model", "m", "--user", template
        )
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert f"the prompt fails on the first row of {data}" in err and words in err, err
        assert "Secret" not in err


async def test_submit_wait_status_results(
    workers: Settings, tmp_path: Path, model_name: str
) -> None:
    data = tmp_path / "tickets.jsonl"
    data.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(25)))
    job = f"cli-{uuid.uuid4().hex[:8]}"
    code, out, err = await cli(
        workers, "submit", "--input", str(data), "--model", model_name, "--job-id", job,
        "--system", "Label the ticket.", "--user", "{{ text }}", "--choices", "bug,billing",
        "--output", f"file://{tmp_path / 'out'}", "--shard-size", "10", "--wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    assert summary["state"] == "succeeded" and summary["items_succeeded"] == 25

    code, out, _ = await cli(workers, "status", job, "--json")
    status = json.loads(out)
    assert code == 0 and status["workflow_status"] == "completed"
    assert status["items_total"] == 25 and status["shards_total"] == 3

    code, out, _ = await cli(workers, "results", job, "--json", "-n", "4")
    results = json.loads(out)
    assert code == 0 and len(results["rows"]) == 4
    assert all(r["text"] in ("bug", "billing") for r in results["rows"])

    code, _, err = await cli(workers, "status", "no-such-job")
    assert code == 1 and "no job 'no-such-job'" in err


async def test_submitting_the_same_job_id_twice_returns_the_running_job(
    workers: Settings, temporal_client: Client, tmp_path: Path, model_name: str
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(30)))
    job = f"cli-twice-{uuid.uuid4().hex[:8]}"
    args = [
        "submit", "--input", str(data), "--model", model_name, "--job-id", job,
        "--user", "{{ text }}", "--choices", "bug,billing", "--shard-size", "10",
        "--output", f"file://{tmp_path / 'out'}", "--json",
    ]  # fmt: skip
    (code1, out1, err1), (code2, out2, err2) = [await cli(workers, *args) for _ in range(2)]
    assert (code1, code2) == (0, 0), err1 + err2
    first, second = json.loads(out1), json.loads(out2)
    assert (first["started"], second["started"]) == (True, False)
    assert first["run_id"] == second["run_id"]
    handle = temporal_client.get_workflow_handle(job, result_type=JobSummary)
    summary = await asyncio.wait_for(handle.result(), 300)
    assert summary.items_succeeded == 30
    runs = [e async for e in temporal_client.list_workflows(f"WorkflowId = '{job}'")]
    assert len(runs) == 1
    rows = [
        line for part in (tmp_path / "out" / job).glob("part-*.jsonl")
        for line in part.read_text().split("\n")[:-1]
    ]  # fmt: skip
    assert len(rows) == 30
