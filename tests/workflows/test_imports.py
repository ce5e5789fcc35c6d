"""Workflow modules import only the contract: the sandbox re-imports whatever they
import on every run, and an I/O library imported there (asyncpg, boto3, vLLM) has
crashed a worker before. Checked in a fresh interpreter, so the test sees exactly
what importing the workflows pulls in, transitively."""

from __future__ import annotations

import json
import subprocess
import sys

WORKFLOW_MODULES = ["workflows.batch_job", "workflows.shard", "workflows.dead_letter"]
FORBIDDEN = ("asyncpg", "boto3", "botocore", "vllm", "torch", "jinja2", "pyarrow")


def test_workflows_import_only_the_contract_of_llmbatch() -> None:
    script = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in WORKFLOW_MODULES)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    modules = json.loads(done.stdout)
    ours = [m for m in modules if m.startswith("llmbatch.")]
    assert ours, "the workflows import no contract at all?"
    assert [m for m in ours if not m.startswith("llmbatch.contract")] == []
    assert [m for m in modules if m.split(".")[0] in FORBIDDEN] == []
