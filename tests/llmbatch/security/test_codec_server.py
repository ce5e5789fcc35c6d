"""``llm-batch codec-server``: Temporal's remote codec protocol behind an API key,
run as the real command on a free port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from llmbatch.client.temporal import data_converter
from llmbatch.devstack.process import free_port
from llmbatch.security.codec import Keyring, new_keyring

API_KEY = "codec-server-test-key-91b2"
UI_ORIGIN = "http://127.0.0.1:8233"
CANARY = "canary-codec-server-77"


@pytest.fixture(scope="module")
def keyring() -> Keyring:
    return new_keyring()


@contextlib.contextmanager
def running_codec_server(
    keyring: Keyring, ui_origin: str, *, api_key: str = API_KEY
) -> Iterator[tuple[str, str]]:
    """``llm-batch codec-server`` on a free port; yields its URL and API key. On exit,
    checks that its log holds neither the key nor a payload's plaintext."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="codec-server-") as folder:
        log = Path(folder) / "codec-server.log"
        env = {
            **os.environ,
            "LLMBATCH_CODEC_KEYS": keyring.to_json(),
            "LLMBATCH_CODEC_SERVER_API_KEY": api_key,
        }
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmbatch.cli.main", "codec-server", "--port", str(port),
                 "--ui-origin", ui_origin],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                assert proc.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    httpx.post(f"{url}/decode", json={"payloads": []}, timeout=1)
                    break
                time.sleep(0.1)
            yield url, api_key
        finally:
            proc.terminate()
            proc.wait(10)
        text = log.read_text()
        assert api_key not in text and CANARY not in text


@pytest.fixture(scope="module")
def codec_server(keyring: Keyring) -> Iterator[str]:
    with running_codec_server(keyring, UI_ORIGIN) as (url, _):
        yield url


async def sealed_body(keyring: Keyring) -> dict[str, object]:
    payloads = await data_converter(keyring).encode([{"row": CANARY}])
    return json_format.MessageToDict(Payloads(payloads=payloads))


async def test_decode_gives_the_payload_back_with_the_key_and_nothing_without(
    codec_server: str, keyring: Keyring
) -> None:
    body = await sealed_body(keyring)
    assert CANARY not in str(body)
    async with httpx.AsyncClient(base_url=codec_server, timeout=10) as http:
        ok = await http.post("/decode", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        # The Web UI's form: the key as the endpoint's first path segment.
        by_path = await http.post(f"/{API_KEY}/decode", json=body)
        refused = [
            await http.post("/decode", json=body),
            await http.post("/decode", json=body, headers={"Authorization": "Bearer wrong"}),
            await http.post("/wrong/decode", json=body),
        ]
        # Round trip through /encode and back.
        encoded = await http.post(
            "/encode", json=ok.json(), headers={"Authorization": f"Bearer {API_KEY}"}
        )

    assert ok.status_code == 200 and by_path.status_code == 200
    (payload,) = json_format.ParseDict(ok.json(), Payloads()).payloads
    assert payload.metadata["encoding"] == b"json/plain"
    assert CANARY.encode() in payload.data
    assert by_path.json() == ok.json()
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert all(CANARY not in r.text for r in refused)
    assert encoded.status_code == 200 and CANARY not in encoded.text


async def test_the_web_ui_origin_may_call_it_from_a_browser_and_others_may_not(
    codec_server: str,
) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-namespace",
    }
    async with httpx.AsyncClient(base_url=codec_server, timeout=10) as http:
        ui = await http.options("/decode", headers={"Origin": UI_ORIGIN, **preflight})
        other = await http.options(
            "/decode", headers={"Origin": "http://evil.example", **preflight}
        )
    assert ui.status_code == 200
    assert ui.headers["access-control-allow-origin"] == UI_ORIGIN
    assert "x-namespace" in ui.headers["access-control-allow-headers"].lower()
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"
