"""The job commands, run as a real ``llm-batch`` process against the session's stack.

The workers run in this test process's event loop, so the CLI runs as an async
subprocess while the test awaits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from llmbatch.config import Settings
from llmbatch.contract.messages import JobSummary
from llmbatch.contract.names import shard_workflow_id
from llmbatch.devstack.demo import settings_env

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


async def test_submit_for_a_model_no_worker_serves_warns_or_refuses(
    workers: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"ticket {i}"}) + "\n" for i in range(5)))
    model = f"/models/nobody-serves-{uuid.uuid4().hex[:6]}"
    job = f"cli-noworker-{uuid.uuid4().hex[:8]}"
    args = [
        "submit", "--input", str(data), "--model", model, "--user", "{{ text }}",
        "--output", f"file://{tmp_path / 'out'}", "--json",
    ]  # fmt: skip

    code, _, err = await cli(workers, *args, "--job-id", f"{job}-refused", "--require-worker")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"no worker serves model {model}" in err
    runs = [e async for e in temporal_client.list_workflows(f"WorkflowId = '{job}-refused'")]
    assert runs == []  # refused before anything was scheduled

    code, out, err = await cli(workers, *args, "--job-id", job)
    try:
        assert code == 0 and json.loads(out)["started"], err
        assert f"warning: no worker serves model {model}" in " ".join(err.split())
        # Planned and rendered, the job waits for the model's worker: status says so.
        for _ in range(120):
            code, out, _ = await cli(workers, "status", job, "--json")
            if json.loads(out)["waiting_for_worker"]:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"status never said it waits for a worker: {out}")
        code, out, _ = await cli(workers, "status", job)
        assert code == 0 and f"waiting for a worker serving {model}" in " ".join(out.split())
    finally:
        await temporal_client.get_workflow_handle(job).cancel()


async def test_submit_refuses_local_files_outside_the_roots(
    stack: Settings, s3_client: Any, tmp_path: Path
) -> None:
    # The session's roots are its basetemp and the project folder (tests/fixtures/stack.py).
    user = ["--model", "m", "--user", "{{ NAME }}"]
    code, _, err = await cli(
        stack, "submit", "--input", "/etc/os-release", "--format", "csv", *user
    )
    assert code == 1 and "/etc/os-release" in err and "LLMBATCH_LOCAL_ROOTS" in err
    assert len(err.strip().splitlines()) == 1 and "Debian" not in err and "NAME=" not in err

    # A symlink under a root that points out of the roots is refused as well.
    link = tmp_path / "rows.csv"
    link.symlink_to("/etc/os-release")
    code, _, err = await cli(stack, "submit", "--input", str(link), "--format", "csv", *user)
    assert code == 1 and "LLMBATCH_LOCAL_ROOTS" in err and "NAME=" not in err

    data = tmp_path / "ok.csv"
    data.write_text("NAME\nAcme\n")

    async def submit_to(output: str) -> tuple[int, str]:
        code, _, err = await cli(stack, "submit", "--input", str(data), "--output", output, *user)
        return code, err

    code, err = await submit_to("file:///x/../../y")
    assert code == 1 and "output_uri" in err and "'..'" in err
    code, err = await submit_to("gs://b/out")
    assert code == 1 and "unsupported scheme 'gs'" in err
    code, err = await submit_to("/etc/llm-out")
    assert code == 1 and "/etc/llm-out" in err and "LLMBATCH_LOCAL_ROOTS" in err

    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    code, err = await submit_to(f"s3://{missing}/out")
    assert code == 1 and f"bucket '{missing}' does not exist" in err
    assert missing not in [b["Name"] for b in s3_client.list_buckets()["Buckets"]]


async def test_a_root_of_slash_lets_submit_read_any_file(stack: Settings) -> None:
    # The file is read (its fields are checked against the prompt): no roots refusal.
    everywhere = stack.model_copy(update={"local_roots": [Path("/")]})
    code, _, err = await cli(
        everywhere, "submit", "--input", "/etc/os-release", "--format", "csv",
        "--model", "m", "--user", "{{ no_such_field }}",
    )  # fmt: skip
    assert code == 1 and "no_such_field" in err and "LLMBATCH_LOCAL_ROOTS" not in err


# --- refused at submit: one line, exit 1, and no workflow started --------------------


async def assert_no_job(client: Client, job: str) -> None:
    with pytest.raises(RPCError) as missing:
        await client.get_workflow_handle(job).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND


async def refused(
    settings: Settings, client: Client, tmp_path: Path, *args: str, user: str | None = "{{ x }}"
) -> str:
    """Submit with ``args`` under a fresh job id; assert it is refused in one line with
    exit code 1 and that no workflow was started; return the error line."""
    job = f"refused-{uuid.uuid4().hex[:8]}"
    prompt = ["--user", user] if user is not None else []
    code, out, err = await cli(
        settings, "submit", "--model", "m", "--job-id", job,
        "--output", f"file://{tmp_path / 'out'}", *prompt, *args,
    )  # fmt: skip
    assert code == 1, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    await assert_no_job(client, job)
    return lines[0]


async def test_inputs_without_rows_are_refused_at_submit(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    header_only = tmp_path / "header-only.csv"
    header_only.write_text("x,y\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    for path, user in ((header_only, "{{ x }}"), (empty, "{{ x }}"), (empty, None)):
        line = await refused(stack, temporal_client, tmp_path, "--input", str(path), user=user)
        assert f"input has no rows: {path}" in line


async def test_an_invalid_json_schema_is_refused_at_submit(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"x": 1}\n')
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}))
    line = await refused(
        stack, temporal_client, tmp_path, "--input", str(data), "--json-schema", str(schema)
    )
    assert "sampling.json_schema" in line and "not a valid JSON Schema" in line
    assert "properties/a/type" in line


async def test_option_files_that_are_missing_or_not_json_are_one_line(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"x": 1}\n')
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    missing = tmp_path / "missing.json"
    inputs = ("--input", str(data))
    cases: list[tuple[tuple[str, ...], str]] = [
        (("--spec", str(missing)), f"--spec {missing}: no such file"),
        (("--spec", str(broken)), f"--spec {broken}: not JSON (Expecting property name"),
        (("--spec", str(tmp_path)), f"--spec {tmp_path}: cannot read it"),
        (("--json-schema", str(missing)), f"--json-schema {missing}: no such file"),
        (("--json-schema", str(binary)), f"--json-schema {binary}: not a text file"),
        (("--json-schema", str(broken)), f"--json-schema {broken}: not JSON"),
    ]
    for args, message in cases:
        assert message in await refused(stack, temporal_client, tmp_path, *inputs, *args)
    for args, message in [
        (("--messages", str(missing)), f"--messages {missing}: no such file"),
        (("--messages", str(broken)), f"--messages {broken}: not JSON"),
    ]:
        line = await refused(stack, temporal_client, tmp_path, *inputs, *args, user=None)
        assert message in line


async def test_an_existing_job_id_with_another_spec_is_refused_unless_attached(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"x": 1}\n')
    job = f"cli-resubmit-{uuid.uuid4().hex[:8]}"
    # No GPU worker serves model "m": the job stays running while we resubmit.
    args = [
        "submit", "--input", str(data), "--model", "m", "--job-id", job, "--user", "{{ x }}",
        "--output", f"file://{tmp_path / 'out'}", "--json",
    ]  # fmt: skip
    try:
        code, out, err = await cli(stack, *args)
        assert code == 0, err
        first = json.loads(out)

        code, out, err = await cli(stack, *args)  # the same spec: the same job
        assert code == 0, err
        assert (json.loads(out)["started"], json.loads(out)["run_id"]) == (False, first["run_id"])

        code, out, err = await cli(stack, *args, "--max-tokens", "7")
        assert code == 1 and out == ""
        # (Before it, a warning that no worker serves model "m".)
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            f"error: job {job} exists with a different spec; use --attach to follow it or "
            "pick another id (it differs in: sampling)"
        ]

        code, out, err = await cli(stack, *args, "--max-tokens", "7", "--attach")
        assert code == 0, err
        assert (json.loads(out)["started"], json.loads(out)["run_id"]) == (False, first["run_id"])
        runs = [e async for e in temporal_client.list_workflows(f"WorkflowId = '{job}'")]
        assert len(runs) == 1
    finally:
        # Its one shard too, should a CPU worker of this session have planned it.
        for workflow_id in (job, shard_workflow_id(job, 0)):
            with contextlib.suppress(RPCError):
                await temporal_client.get_workflow_handle(workflow_id).terminate("test done")
