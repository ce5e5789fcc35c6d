"""``llm-batch dev up --encrypt``: a keyring in the state folder that every process
using the folder encrypts with, and a codec server the Web UI is pointed at.

Only the two parts that matter here run (Temporal and the codec server), on a state
folder and ports of their own; the UI's codec endpoint is read from the Web UI's own
settings, and the decoded payload is fetched from it as the UI fetches it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from llmbatch.client.temporal import connect, start_job
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec
from llmbatch.devstack import DevStack, DevStackError, isolated_settings
from llmbatch.devstack.parts import (
    CodecServerPart,
    TemporalPart,
    codec_api_key_path,
    codec_endpoint,
)
from llmbatch.devstack.process import free_port
from llmbatch.security.codec import ENCODING, state_keyring_path

pytestmark = pytest.mark.slow

CANARY = "devcanary-2b7e"


@pytest.fixture
def encrypted_stack(tmp_path: Path) -> Iterator[Settings]:
    settings = isolated_settings(tmp_path / "state")
    settings = settings.model_copy(
        update={"codec_server_port": free_port(avoid={settings.temporal_port})}
    )
    assert DevStack(settings).enable_encryption()
    assert not DevStack(settings).enable_encryption()  # made once, kept after
    parts = [CodecServerPart(settings), TemporalPart(settings)]
    try:
        for part in parts:
            part.plan_ports(set())
            part.start()
        yield settings
    finally:
        for part in parts:
            part.stop()


async def test_dev_up_encrypt_points_the_web_ui_at_a_codec_server_that_decodes(
    encrypted_stack: Settings,
) -> None:
    settings = encrypted_stack
    for secret in (state_keyring_path(settings), codec_api_key_path(settings)):
        assert secret.stat().st_mode & 0o777 == 0o600
    status = DevStack(settings).status()
    assert (
        status.encrypted and status.codec_server == f"http://127.0.0.1:{settings.codec_server_port}"
    )
    api_key = codec_api_key_path(settings).read_text()
    assert api_key not in status.model_dump_json() + status.describe()

    # The Web UI was started with the codec endpoint.
    async with httpx.AsyncClient(timeout=10) as http:
        ui = (await http.get(f"{settings.web_ui_url}/api/v1/settings")).json()
    endpoint = ui["Codec"]["Endpoint"]
    assert endpoint == codec_endpoint(settings)

    # A process using the state folder encrypts with its keyring (the start input of a
    # job no worker takes is enough).
    client = await connect(settings)
    spec = JobSpec(
        job_id=f"enc-{uuid.uuid4().hex[:8]}",
        inputs=["s3://nowhere/in.jsonl"],
        messages=[ChatMessage(role="user", content=f"{CANARY} {{{{ x }}}}")],
        model="m",
        output_uri="s3://nowhere/out",
    )
    handle, _ = await start_job(client, spec, settings=settings)
    try:
        async for event in handle.fetch_history_events(page_size=1):
            started = event.workflow_execution_started_event_attributes.input
            break
        (sealed,) = started.payloads
        assert sealed.metadata["encoding"] == ENCODING
        assert CANARY.encode() not in sealed.SerializeToString()

        # What the Web UI does with it: POST it to <endpoint>/decode from its origin.
        body = json_format.MessageToDict(Payloads(payloads=[sealed]))
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(
                f"{endpoint}/decode",
                json=body,
                headers={"Origin": settings.web_ui_url, "X-Namespace": settings.temporal_namespace},
            )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == settings.web_ui_url
        (plain,) = json_format.ParseDict(answer.json(), Payloads()).payloads
        assert CANARY.encode() in plain.data
    finally:
        await handle.terminate()


def test_encryption_cannot_be_turned_on_under_a_running_temporal(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "state")
    temporal = TemporalPart(settings)
    temporal.plan_ports(set())
    temporal.start()
    try:
        dev = DevStack(settings)
        dev._save([temporal])  # as `dev up` records it
        with pytest.raises(DevStackError, match="without a codec endpoint"):
            dev.enable_encryption()
        assert not state_keyring_path(settings).exists()
    finally:
        temporal.stop()
