"""Upstream starts: a process that knows only the documented contract starts real jobs.

The starting code (foreign_client.py) imports nothing of llm-batch and runs as its
own process with the SDK's default data converter and no LLMBATCH_* settings; this
module only hands it the session stack's address, queue and bucket as plain strings
and checks what comes back.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from llmbatch.config import Settings
from llmbatch.storage.s3 import split_s3

pytestmark = pytest.mark.slow

FOREIGN_CLIENT = Path(__file__).with_name("foreign_client.py")
ROWS = 30
LABELS = ["Healthcare", "Retail", "Other"]


async def start_from_elsewhere(
    settings: Settings, workflow_id: str, job: dict[str, Any]
) -> dict[str, Any]:
    """Run the foreign client; its printed outcome as a dict."""
    proc = await asyncio.create_subprocess_exec(
        # -I: isolated, so neither this tree nor PYTHONPATH is on its import path.
        sys.executable, "-I", str(FOREIGN_CLIENT),
        settings.temporal_address, settings.temporal_namespace, settings.cpu_task_queue,
        workflow_id, json.dumps(job),
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()
    outcome: dict[str, Any] = json.loads(out)
    assert outcome["llmbatch_modules"] == []
    return outcome


def job_json(bucket: str, model: str) -> dict[str, Any]:
    """A job as another language would write it: plain JSON matching `llm-batch schema`."""
    return {
        "inputs": [f"s3://{bucket}/in/companies.jsonl"],
        "id_field": "id",
        "messages": [
            {"role": "system", "content": "Classify the company."},
            {"role": "user", "content": "Company: {{ name }}"},
        ],
        "model": model,
        "sampling": {"choice": LABELS, "max_tokens": 8},
        "shard_size": 10,
        "output_uri": f"s3://{bucket}/out",
    }


@pytest.fixture
def companies(bucket: str, s3_client: Any) -> list[str]:
    ids = [f"c{i:03d}" for i in range(ROWS)]
    body = "".join(json.dumps({"id": i, "name": f"Company {i} Clinic"}) + "\n" for i in ids)
    s3_client.put_object(Bucket=bucket, Key="in/companies.jsonl", Body=body.encode())
    return ids


def output_item_ids(s3_client: Any, manifest_uri: str) -> list[str]:
    bucket, key = split_s3(manifest_uri)
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    ids = []
    for part in manifest["output_parts"]:
        part_key = part.removeprefix(f"s3://{bucket}/")
        body = s3_client.get_object(Bucket=bucket, Key=part_key)["Body"].read().decode()
        ids += [json.loads(line)["item_id"] for line in body.splitlines() if line]
    return ids


async def test_a_service_without_llm_batch_starts_a_job_with_a_json_object(
    workers: Settings, bucket: str, s3_client: Any, companies: list[str], model_name: str
) -> None:
    job_id = f"upstream-{uuid.uuid4().hex[:8]}"
    job = {"spec": {"job_id": job_id, **job_json(bucket, model_name)}}

    outcome = await start_from_elsewhere(workers, job_id, job)

    summary = outcome["result"]
    assert summary["job_id"] == job_id and summary["state"] == "succeeded"
    assert (summary["items_total"], summary["items_succeeded"], summary["items_dead"]) == (
        ROWS,
        ROWS,
        0,
    )
    assert summary["shards_total"] == 3
    assert summary["output_root"] == f"s3://{bucket}/out/{job_id}"
    assert sorted(output_item_ids(s3_client, summary["manifest"])) == companies


async def test_a_bare_job_spec_without_job_id_takes_the_workflow_id(
    workers: Settings, bucket: str, s3_client: Any, companies: list[str], model_name: str
) -> None:
    workflow_id = f"upstream-{uuid.uuid4().hex[:8]}"

    outcome = await start_from_elsewhere(workers, workflow_id, job_json(bucket, model_name))

    summary = outcome["result"]
    assert summary["job_id"] == workflow_id
    assert (summary["items_total"], summary["items_succeeded"]) == (ROWS, ROWS)
    assert sorted(output_item_ids(s3_client, summary["manifest"])) == companies


async def test_a_job_id_other_than_the_workflow_id_is_refused(
    workers: Settings, bucket: str, companies: list[str], model_name: str
) -> None:
    workflow_id = f"upstream-{uuid.uuid4().hex[:8]}"
    job = {"job_id": "someone-else", **job_json(bucket, model_name)}

    outcome = await start_from_elsewhere(workers, workflow_id, job)

    assert "result" not in outcome
    assert "differs from the workflow id" in outcome["error"]
