"""A GPU worker started with vLLM's ``--served-model-name`` is known by that name: it
polls the name's queue, ``GET /v1/models`` lists the name (not the path it loaded),
and a batch naming it runs there (a real worker process and the session's server)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from llmbatch.config import Settings
from tests.fixtures.api_server import ApiServer, Keys
from tests.fixtures.worker_processes import gpu_worker_process, stop_worker
from tests.llmbatch.api.helpers import batch_file, lines_of, new_client, until

pytestmark = pytest.mark.slow


async def test_a_model_loaded_from_a_path_is_listed_and_run_under_its_served_name(
    workers: Settings, api_server: ApiServer, api_keys: Keys, model_name: str, tmp_path: Path
) -> None:
    name = f"tiny-served-{uuid.uuid4().hex[:6]}"
    assert "/" in model_name  # the session's tiny model is a local path
    proc = gpu_worker_process(
        workers, model_name, tmp_path / "served.log", "--served-model-name", name
    )
    client, _ = await new_client(api_server, api_keys)
    try:
        for _ in range(600):  # the engine loads (tens of seconds on a busy machine)
            listed = {m.id: m async for m in client.models.list()}
            if name in listed:
                break
            assert proc.poll() is None, proc.exit_message()
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"GET /v1/models never listed {name}")
        assert (listed[name].model_extra or {})["tasks"] == ["generate"]
        assert (await client.models.retrieve(name)).id == name

        f = await client.files.create(file=("in.jsonl", batch_file(name, 3)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await until(client, batch.id, lambda b: b.status in {"completed", "failed"})
        assert (
            done.status == "completed"
            and done.request_counts is not None
            and done.request_counts.completed == 3
        ), done
        lines = await lines_of(client, done.output_file_id)
        assert {line["response"]["body"]["model"] for line in lines} == {name}
    finally:
        stop_worker(proc)
