"""Key rotation: a job started under key A finishes after its workers switch to a
keyring whose current key is B (A kept to decrypt what it sealed)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.client import Client

from llmbatch.cli._support.jobview import last_task_failure
from llmbatch.client.temporal import connect, start_job, started_spec
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.security.codec import META_KEY_ID, new_keyring
from llmbatch.workers.cpu import cpu_worker
from llmbatch.workers.gpu import gpu_worker
from tests.llmbatch.cli.test_jobs import cli
from tests.llmbatch.security.test_canary import payloads_in, workflow_ids
from tests.workflows.test_batch_job import classify_on_disk, companies

pytestmark = pytest.mark.slow

ROWS = 24
SHARD_SIZE = 6


async def test_a_job_started_under_key_a_finishes_after_the_workers_switch_to_key_b(
    stack: Settings,
    engine: Any,
    model_name: str,
    temporal_client: Client,
    tmp_path: Path,
) -> None:
    tag = uuid.uuid4().hex[:8]
    base = stack.model_copy(
        update={"cpu_task_queue": f"rot-{tag}", "gpu_task_queue_prefix": f"rot-{tag}-gpu"}
    )
    key_a = new_keyring()
    key_b = key_a.rotated()
    under_a = base.model_copy(update={"codec_keys": SecretStr(key_a.to_json())})
    under_b = base.model_copy(update={"codec_keys": SecretStr(key_b.to_json())})
    spec = classify_on_disk(
        tmp_path, companies(ROWS), model_name, shard_size=SHARD_SIZE, max_concurrent_shards=1
    )

    client_a = await connect(under_a)
    async with (
        cpu_worker(under_a, client=client_a),
        gpu_worker(under_a, engine, model=model_name, client=client_a),
    ):
        handle, _ = await start_job(client_a, spec, settings=under_a)
        for _ in range(3000):
            progress = await handle.query("progress", result_type=JobProgress)
            if progress.shards_done >= 1:
                break
            await asyncio.sleep(0.1)
    assert 1 <= progress.shards_done < progress.shards_total  # switched mid-job

    client_b = await connect(under_b)
    async with (
        cpu_worker(under_b, client=client_b),
        gpu_worker(under_b, engine, model=model_name, client=client_b),
    ):
        finishing = client_b.get_workflow_handle(handle.id, result_type=JobSummary)
        summary = await asyncio.wait_for(finishing.result(), 300)
    assert (summary.state, summary.items_succeeded) == ("succeeded", ROWS)

    # Key B reads what key A sealed; key A alone cannot read what B sealed.
    assert await started_spec(client_b, handle.id) == spec
    key_ids: set[bytes] = set()
    for workflow_id in workflow_ids(spec, summary):
        if workflow_id.endswith("/dlq"):
            continue  # no dead items: never started
        history = await temporal_client.get_workflow_handle(workflow_id).fetch_history()
        for event in history.events:
            key_ids |= {
                p.metadata[META_KEY_ID] for p in payloads_in(event) if META_KEY_ID in p.metadata
            }
    assert key_ids == {key_a.current.encode(), key_b.current.encode()}


async def test_status_names_the_key_a_worker_lacks_after_a_rotation(
    stack: Settings, model_name: str, tmp_path: Path
) -> None:
    """The client rotated to key B but the CPU workers kept a keyring of key A only:
    the job's workflow task cannot be decoded, and `status` says which key is missing
    (not just Temporal's "Workflow Task in failed state")."""
    tag = uuid.uuid4().hex[:8]
    base = stack.model_copy(update={"cpu_task_queue": f"rot-lack-{tag}"})
    key_a = new_keyring()
    key_b = key_a.rotated()
    under_a = base.model_copy(update={"codec_keys": SecretStr(key_a.to_json())})
    under_b = base.model_copy(update={"codec_keys": SecretStr(key_b.to_json())})
    spec = classify_on_disk(tmp_path, companies(4), model_name, shard_size=4)

    client_a, client_b = await connect(under_a), await connect(under_b)
    handle, _ = await start_job(client_b, spec, settings=under_b)
    try:
        async with cpu_worker(under_a, client=client_a):
            for _ in range(300):
                if await last_task_failure(client_b, handle) is not None:
                    break
                await asyncio.sleep(0.1)
            code, _, err = await cli(under_b, "status", spec.job_id)
        assert code == 1, err
        assert f"key '{key_b.current}', which the keyring does not hold" in err, err
        assert "codec-key rotate" in err and "Workflow Task in failed state" not in err
    finally:
        await handle.terminate("test over")
